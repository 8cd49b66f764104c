"""Reference models that exercise sparse kernels end to end."""
