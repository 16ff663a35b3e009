// Probes cuBLASLt on the GPU machine (nvcc, no Rust) before Kiln's code relies on it:
//  1. whether FP32 GEMMs take the RELU_AUX_BIAS and DRELU_BGRAD epilogues (the MLP's
//     forward ReLU mask and its gradient), and the mask's bit layout, checked on the host;
//  2. for the Transformer-forward products (M = 320 rows), how the heuristic's top choice
//     compares with split-K variants of its candidates, each timed as 20 runs in a graph.
//   nvcc -O2 -o lt_probe lt_probe.cpp -lcublasLt -lcudart && ./lt_probe
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cmath>
#include <algorithm>
#define CK(x) do { auto r_ = (x); if ((int)r_ != 0) { printf("%s:%d %s -> %d\n", __FILE__, __LINE__, #x, (int)r_); exit(1); } } while (0)

static cublasLtHandle_t lt;
static void* ws;
static const size_t WS = 32 << 20;
static cudaStream_t st;

struct Prob {
  cublasLtMatmulDesc_t d; cublasLtMatrixLayout_t a, b, c;
};
static Prob make(int m, int n, int k, bool ta, cublasLtEpilogue_t e, long aux_ld) {
  Prob p;
  CK(cublasLtMatmulDescCreate(&p.d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  int t = ta ? 1 : 0;
  CK(cublasLtMatmulDescSetAttribute(p.d, CUBLASLT_MATMUL_DESC_TRANSA, &t, 4));
  CK(cublasLtMatmulDescSetAttribute(p.d, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, 4));
  if (aux_ld) CK(cublasLtMatmulDescSetAttribute(p.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, 8));
  CK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_32F, ta ? k : m, ta ? m : k, ta ? k : m));
  CK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_32F, k, n, k));
  CK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_32F, m, n, m));
  return p;
}
static std::vector<cublasLtMatmulHeuristicResult_t> heur(Prob& p, int want) {
  cublasLtMatmulPreference_t pr;
  CK(cublasLtMatmulPreferenceCreate(&pr));
  uint64_t w = WS;
  CK(cublasLtMatmulPreferenceSetAttribute(pr, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &w, 8));
  std::vector<cublasLtMatmulHeuristicResult_t> r(want);
  int got = 0;
  auto s = cublasLtMatmulAlgoGetHeuristic(lt, p.d, p.a, p.b, p.c, p.c, pr, want, r.data(), &got);
  if (s != CUBLAS_STATUS_SUCCESS) { printf("  heuristic status %d\n", (int)s); got = 0; }
  r.resize(got);
  return r;
}
static float* dev(std::vector<float>& h) {
  float* p; CK(cudaMalloc(&p, h.size() * 4 + 4096)); CK(cudaMemcpy(p, h.data(), h.size() * 4, cudaMemcpyHostToDevice)); return p;
}
static std::vector<float> host(float* p, size_t n) { std::vector<float> h(n); CK(cudaMemcpy(h.data(), p, n * 4, cudaMemcpyDeviceToHost)); return h; }
static std::vector<float> rnd(size_t n, unsigned s) { std::vector<float> v(n); for (auto& x : v) { s = s * 1664525u + 1013904223u; x = ((s >> 8) / 16777216.0f) - 0.5f; } return v; }
static cublasStatus_t run(Prob& p, const cublasLtMatmulAlgo_t* al, float* A, float* B, float* D) {
  float one = 1, zero = 0;
  return cublasLtMatmul(lt, p.d, &one, A, p.a, B, p.b, &zero, D, p.c, D, p.c, al, ws, WS, st);
}

static void epilogues(int m, int n, int k) {
  printf("== epilogues FP32, D[%d, %d] = A[%d, %d] B[%d, %d]\n", m, n, m, k, k, n);
  long ld = (m + 127) / 128 * 128;
  auto A = rnd((size_t)m * k, 1), B = rnd((size_t)k * n, 2), bias = rnd(m, 3);
  float *dA = dev(A), *dB = dev(B), *dbias = dev(bias), *dD, *dAux, *dD2, *dG;
  CK(cudaMalloc(&dD, (size_t)m * n * 4)); CK(cudaMalloc(&dAux, ld * n / 8 + 256)); CK(cudaMemset(dAux, 0, ld * n / 8 + 256));
  Prob f = make(m, n, k, false, CUBLASLT_EPILOGUE_RELU_AUX_BIAS, ld);
  CK(cublasLtMatmulDescSetAttribute(f.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &dbias, 8));
  CK(cublasLtMatmulDescSetAttribute(f.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &dAux, 8));
  auto h = heur(f, 8);
  printf("  RELU_AUX_BIAS: %zu algorithms\n", h.size());
  if (h.empty()) return;
  CK(run(f, &h[0].algo, dA, dB, dD));
  CK(cudaStreamSynchronize(st));
  auto D = host(dD, (size_t)m * n);
  std::vector<unsigned char> mask(ld * n / 8);
  CK(cudaMemcpy(mask.data(), dAux, mask.size(), cudaMemcpyDeviceToHost));
  std::vector<float> pre((size_t)m * n);
  int bad_d = 0, bad_lsb = 0, bad_msb = 0;
  for (int c = 0; c < n; ++c) for (int r = 0; r < m; ++r) {
    double s = bias[r];
    for (int i = 0; i < k; ++i) s += (double)A[(size_t)i * m + r] * B[(size_t)c * k + i];
    pre[(size_t)c * m + r] = s;
    if (fabs(D[(size_t)c * m + r] - std::max(s, 0.0)) > 1e-3) ++bad_d;
    size_t bit = (size_t)c * ld + r;
    bool lsb = (mask[bit / 8] >> (bit % 8)) & 1, msb = (mask[bit / 8] >> (7 - bit % 8)) & 1;
    if (fabs(s) > 1e-4) { bad_lsb += lsb != (s > 0); bad_msb += msb != (s > 0); }
  }
  printf("  relu out mismatches %d; mask as bit c*ld+r, LSB first: %d wrong, MSB first: %d wrong\n", bad_d, bad_lsb, bad_msb);
  // Backward: G2[m, n] = A2[m, 10] B2[10, n], times the mask, and its row sums.
  int k2 = 10;
  auto A2 = rnd((size_t)m * k2, 4), B2 = rnd((size_t)k2 * n, 5);
  float *dA2 = dev(A2), *dB2 = dev(B2);
  CK(cudaMalloc(&dD2, (size_t)m * n * 4)); CK(cudaMalloc(&dG, m * 4));
  for (auto e : {CUBLASLT_EPILOGUE_DRELU_BGRAD, CUBLASLT_EPILOGUE_DRELU}) {
    Prob b = make(m, n, k2, false, e, ld);
    CK(cublasLtMatmulDescSetAttribute(b.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &dAux, 8));
    if (e == CUBLASLT_EPILOGUE_DRELU_BGRAD) CK(cublasLtMatmulDescSetAttribute(b.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &dG, 8));
    auto hb = heur(b, 8);
    printf("  %s: %zu algorithms\n", e == CUBLASLT_EPILOGUE_DRELU ? "DRELU" : "DRELU_BGRAD", hb.size());
    if (hb.empty()) continue;
    CK(run(b, &hb[0].algo, dA2, dB2, dD2));
    CK(cudaStreamSynchronize(st));
    auto D2 = host(dD2, (size_t)m * n);
    auto G = host(dG, m);
    int bad = 0, badg = 0;
    for (int r = 0; r < m; ++r) {
      double gs = 0;
      for (int c = 0; c < n; ++c) {
        double s = 0;
        for (int i = 0; i < k2; ++i) s += (double)A2[(size_t)i * m + r] * B2[(size_t)c * k2 + i];
        double want = pre[(size_t)c * m + r] > 0 ? s : 0;
        gs += want;
        if (fabs(pre[(size_t)c * m + r]) > 1e-4 && fabs(D2[(size_t)c * m + r] - want) > 1e-4) ++bad;
      }
      if (e == CUBLASLT_EPILOGUE_DRELU_BGRAD && fabs(G[r] - gs) > 1e-3 * (1 + fabs(gs))) ++badg;
    }
    printf("    output mismatches %d, bias-gradient mismatches %d\n", bad, badg);
  }
}

static double time_algo(Prob& p, const cublasLtMatmulAlgo_t& al, float* A, float* B, float* D) {
  if (run(p, &al, A, B, D) != CUBLAS_STATUS_SUCCESS) return 1e9;
  CK(cudaStreamSynchronize(st));
  cudaGraph_t g; cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < 20; ++i) run(p, &al, A, B, D);
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  float best = 1e9;
  for (int r = 0; r < 5; ++r) {
    cudaEventRecord(e0, st); cudaGraphLaunch(ge, st); cudaEventRecord(e1, st); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1); best = std::min(best, ms);
  }
  cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
  return best * 1000.0 / 20;
}

static int cfg(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t at) {
  int v = 0; size_t w; cublasLtMatmulAlgoConfigGetAttribute(&a, at, &v, 4, &w); return v;
}

static void splitk(int n_rows, int N, int K) {
  // Row-major Y[n_rows, N] = X[n_rows, K] W^T + bias: column-major D[N, n_rows] = W[N, K] (stored [K, N], transposed) X^T.
  int m = N, n = n_rows, k = K;
  auto A = rnd((size_t)m * k, 7), B = rnd((size_t)k * n, 8), bias = rnd(m, 9);
  float *dA = dev(A), *dB = dev(B), *dbias = dev(bias), *dD;
  CK(cudaMalloc(&dD, (size_t)m * n * 4));
  Prob p = make(m, n, k, true, CUBLASLT_EPILOGUE_BIAS, 0);
  CK(cublasLtMatmulDescSetAttribute(p.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &dbias, 8));
  auto h = heur(p, 16);
  double flop = 2.0 * m * n * k;
  printf("== [%d, %d] x [%d, %d] + bias (FP32): %zu heuristic candidates\n", n_rows, K, K, N, h.size());
  double first = 1e9, best_h = 1e9, best_s = 1e9; int best_split = 0;
  for (size_t i = 0; i < h.size(); ++i) {
    double us = time_algo(p, h[i].algo, dA, dB, dD);
    if (i == 0) first = us;
    best_h = std::min(best_h, us);
    if (i < 3) printf("  candidate %zu: tile %d split %d scheme %d: %.2f us (%.1f TFLOP/s)\n", i, cfg(h[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID), cfg(h[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), cfg(h[i].algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME), us, flop / us * 1e-6);
    int sup = 0; size_t w; uint32_t mask = 0;
    cublasLtMatmulAlgoCapGetAttribute(&h[i].algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &sup, 4, &w);
    cublasLtMatmulAlgoCapGetAttribute(&h[i].algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &mask, 4, &w);
    if (!sup || i >= 8) continue;
    for (int s : {2, 3, 4, 6, 8}) {
      for (uint32_t scheme : {(uint32_t)CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE, (uint32_t)CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE, (uint32_t)CUBLASLT_REDUCTION_SCHEME_INPLACE}) {
        if (!(mask & scheme)) continue;
        cublasLtMatmulAlgo_t a = h[i].algo;
        cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &s, 4);
        cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, 4);
        cublasLtMatmulHeuristicResult_t r;
        if (cublasLtMatmulAlgoCheck(lt, p.d, p.a, p.b, p.c, p.c, &a, &r) != CUBLAS_STATUS_SUCCESS || r.workspaceSize > WS) continue;
        double us = time_algo(p, a, dA, dB, dD);
        if (us < best_s) { best_s = us; best_split = i * 1000 + s * 10 + scheme; }
      }
    }
  }
  printf("  first %.2f us, best heuristic %.2f us, best split-K %.2f us (%.1f TFLOP/s; candidate %d split %d scheme %d)\n", first, best_h, best_s, flop / best_s * 1e-6, best_split / 1000, best_split % 1000 / 10, best_split % 10);
  cudaFree(dA); cudaFree(dB); cudaFree(dbias); cudaFree(dD);
}

int main() {
  CK(cublasLtCreate(&lt));
  CK(cudaStreamCreate(&st));
  CK(cudaMalloc(&ws, WS));
  epilogues(256, 32, 784);
  epilogues(256, 4096, 784);
  epilogues(200, 64, 100);
  splitk(320, 512, 512);
  splitk(320, 1536, 512);
  splitk(320, 1024, 512);
  splitk(320, 2048, 512);
  splitk(320, 512, 2048);
  splitk(32, 256, 784);
  splitk(4096, 256, 784);
  return 0;
}
