"""Hand-scheduled emitters, one module per kernel family; ``dialects.select`` tries them in order."""
