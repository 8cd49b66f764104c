// Embeds sparse_mlir kernels in C++: a CSR SpMM and a sparse + sparse -> sparse add whose
// result buffers the kernel allocates and example_add_free releases.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "example_add.h"
#include "example_spmm.h"

namespace {

struct Csr {
  int rows, cols;
  std::vector<int32_t> pos, crd;
  std::vector<double> val;
};

Csr random_csr(int rows, int cols, double density, std::mt19937& rng) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  Csr m{rows, cols, std::vector<int32_t>(rows + 1, 0), {}, {}};
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j)
      if (u(rng) < density) {
        m.crd.push_back(j);
        m.val.push_back(u(rng) - 0.5);
      }
    m.pos[i + 1] = static_cast<int32_t>(m.crd.size());
  }
  return m;
}

bool report(const char* what, int32_t status, double err, double tol) {
  bool ok = status == SPARSE_MLIR_OK && err <= tol;
  std::printf("%-28s status=%d max_err=%.3g %s\n", what, status, err, ok ? "ok" : "FAILED");
  return ok;
}

bool spmm(std::mt19937& rng) {
  const int M = 300, K = 200, N = 8;
  Csr a = random_csr(M, K, 0.1, rng);
  std::vector<float> val(a.val.begin(), a.val.end()), b(K * N), c(M * N);
  std::vector<double> ref(M * N, 0.0);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (auto& x : b) x = u(rng);
  for (int i = 0; i < M; ++i)
    for (int p = a.pos[i]; p < a.pos[i + 1]; ++p)
      for (int j = 0; j < N; ++j) ref[i * N + j] += double(val[p]) * b[a.crd[p] * N + j];
  int64_t nnz = a.pos[M];
  int32_t status = example_spmm(a.pos.data(), M + 1, a.crd.data(), nnz, val.data(), nnz, b.data(), K, N, c.data(),
                                M, N);
  double err = 0;
  for (int i = 0; i < M * N; ++i) err = std::fmax(err, std::fabs(c[i] - ref[i]));
  return report("C++ CSR SpMM (float32)", status, err, 1e-4);
}

bool sparse_add(std::mt19937& rng) {
  Csr a = random_csr(50, 40, 0.2, rng), b = random_csr(50, 40, 0.2, rng);
  std::map<std::pair<int, int>, double> ref;
  for (const Csr* m : {&a, &b})
    for (int i = 0; i < 50; ++i)
      for (int p = m->pos[i]; p < m->pos[i + 1]; ++p) ref[{i, m->crd[p]}] += m->val[p];
  example_add_result out{};
  int32_t status = example_add(a.pos.data(), 51, a.crd.data(), a.crd.size(), a.val.data(), a.val.size(),
                               b.pos.data(), 51, b.crd.data(), b.crd.size(), b.val.data(), b.val.size(), &out);
  double err = status == SPARSE_MLIR_OK && out.pos1_len == 51 && out.values_len == out.crd1_len ? 0.0 : 1.0;
  std::size_t seen = 0;
  for (int i = 0; status == SPARSE_MLIR_OK && i < 50; ++i)
    for (int p = out.pos1[i]; p < out.pos1[i + 1]; ++p, ++seen)
      err = std::fmax(err, std::fabs(out.values[p] - ref[{i, out.crd1[p]}]));
  if (seen != ref.size()) err = 1.0;
  example_add_free(&out);
  example_add_free(&out);  // releasing twice is safe
  return report("C++ sparse add -> CSR", status, err, 1e-12);
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  bool ok = spmm(rng);
  ok = sparse_add(rng) && ok;
  return ok ? EXIT_SUCCESS : EXIT_FAILURE;
}
