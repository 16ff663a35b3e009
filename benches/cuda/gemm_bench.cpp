// Times Kiln's 3xTF32 GEMM kernels (`kiln_tensor::cuda::gemm`) against cuBLAS's FP32 SGEMM at
// the benchmark models' shapes, outside Kiln, on the GPU machine (nvcc, no Rust). Each argument
// is a cubin of one variant, compiled from the sources that
// `cargo run --release -p kiln-tensor --example gemm_sources -- DIR` writes, named after its
// kernel (`k_gemm3xtf32_BMxBNxBK_wWMxWN_sS_a{k|m}_b{k|n}.cubin`), which gives its launch.
// Error: the largest |c - ref| / sum_k |a b| over 4096 sampled entries, ref in double.
//   nvcc -O2 -o gemm_bench gemm_bench.cpp -lcuda -lcublas && ./gemm_bench DIR/*.cubin
#include <cuda.h>
#include <cublas_v2.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include <string>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s; cuGetErrorString(r_, &s); printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); exit(1); } } while (0)
#define CB(x) do { cublasStatus_t r_ = (x); if (r_ != CUBLAS_STATUS_SUCCESS) { printf("%s:%d %s: %d\n", __FILE__, __LINE__, #x, (int)r_); exit(1); } } while (0)
struct GArgs { long long m, n, k, sam, sak, sbk, sbn, ldc; int has_bias, relu; };
struct Variant { std::string name; CUfunction f; int bm, bn, bk, wm, wn, stages, a_k, b_k; };
struct Shape { const char* name; long long m, n, k; int a_k, b_k; };
static double lcg(unsigned long long& s) { s = s * 6364136223846793005ULL + 1442695040888963407ULL; return ((s >> 11) * (1.0 / 9007199254740992.0)); }
static long long up4(long long x) { return (x + 3) / 4 * 4; }
int main(int argc, char** argv) {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  std::vector<Variant> vs;
  for (int i = 1; i < argc; ++i) {
    Variant v; const char* base = strrchr(argv[i], '/'); base = base ? base + 1 : argv[i];
    v.name = std::string(base, strlen(base) - 6);
    char a, b;
    if (sscanf(v.name.c_str(), "k_gemm3xtf32_%dx%dx%d_w%dx%d_s%d_a%c_b%c", &v.bm, &v.bn, &v.bk, &v.wm, &v.wn, &v.stages, &a, &b) != 8) { printf("bad name %s\n", base); return 1; }
    v.a_k = a == 'k'; v.b_k = b == 'k';
    CUmodule mod; CK(cuModuleLoad(&mod, argv[i])); CK(cuModuleGetFunction(&v.f, mod, v.name.c_str()));
    int smem = v.stages * ((v.a_k ? v.bm * (v.bk + 4) : v.bk * (v.bm + 8)) + (v.b_k ? v.bn * (v.bk + 4) : v.bk * (v.bn + 8))) * 4;
    CK(cuFuncSetAttribute(v.f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem));
    vs.push_back(v);
  }
  cublasHandle_t h; CB(cublasCreate(&h));
  const Shape shapes[] = {
    {"mlp fwd x W1^T", 4096, 256, 784, 1, 1}, {"mlp dW1 g^T x", 256, 784, 4096, 0, 0},
    {"gpt qkv", 16384, 1152, 384, 1, 1}, {"gpt proj", 16384, 384, 384, 1, 1}, {"gpt fc1", 16384, 1536, 384, 1, 1},
    {"gpt fc2", 16384, 384, 1536, 1, 1}, {"gpt dx fc1", 16384, 384, 1536, 1, 0}, {"gpt dW fc1", 1536, 384, 16384, 0, 0},
    {"tr qkv", 320, 1536, 512, 1, 1}, {"tr ff1", 320, 2048, 512, 1, 1}, {"tr ff2", 320, 512, 2048, 1, 1},
    {"edge ak bk", 999, 250, 101, 1, 1}, {"edge am bn", 1001, 250, 37, 0, 0}, {"edge ak bn", 77, 130, 1000, 1, 0},
  };
  CUevent e0, e1; CK(cuEventCreate(&e0, 0)); CK(cuEventCreate(&e1, 0));
  for (const Shape& s : shapes) {
    // A dense along its contiguous dim with rows padded to 4 floats; likewise B.
    const long long sam = s.a_k ? up4(s.k) : 1, sak = s.a_k ? 1 : up4(s.m);
    const long long sbk = s.b_k ? 1 : up4(s.n), sbn = s.b_k ? up4(s.k) : 1;
    const long long na = s.a_k ? s.m * sam : s.k * sak, nb = s.b_k ? s.n * sbn : s.k * sbk;
    std::vector<float> ha(na), hb(nb); unsigned long long seed = 7;
    for (auto& x : ha) x = (float)(2 * lcg(seed) - 1); for (auto& x : hb) x = (float)(2 * lcg(seed) - 1);
    CUdeviceptr a, b, c; CK(cuMemAlloc(&a, na * 4)); CK(cuMemAlloc(&b, nb * 4)); CK(cuMemAlloc(&c, s.m * s.n * 4));
    CK(cuMemcpyHtoD(a, ha.data(), na * 4)); CK(cuMemcpyHtoD(b, hb.data(), nb * 4));
    std::vector<long long> sample(4096); for (auto& x : sample) x = (long long)(lcg(seed) * s.m * s.n);
    auto err = [&]() {
      std::vector<float> hc(s.m * s.n); CK(cuMemcpyDtoH(hc.data(), c, hc.size() * 4));
      double worst = 0;
      for (long long e : sample) {
        long long i = e / s.n, j = e % s.n; double ref = 0, mag = 0;
        for (long long k = 0; k < s.k; ++k) { double p = (double)ha[i * sam + k * sak] * hb[k * sbk + j * sbn]; ref += p; mag += fabs(p); }
        const double d = fabs(hc[e] - ref) / (mag + 1e-30);
        if (d != d) return (double)INFINITY;
        worst = fmax(worst, d);
      }
      return worst;
    };
    const double flop = 2.0 * s.m * s.n * s.k;
    auto timed = [&](auto run) {
      for (int i = 0; i < 3; ++i) run();
      CK(cuEventRecord(e0, 0)); for (int i = 0; i < 20; ++i) run(); CK(cuEventRecord(e1, 0)); CK(cuEventSynchronize(e1));
      float ms; CK(cuEventElapsedTime(&ms, e0, e1)); return ms * 1e3 / 20;
    };
    // cuBLAS, column-major: C^T [n, m] = B^T A^T.
    const float one = 1, zero = 0;
    auto cub = [&]() {
      CB(cublasSgemm(h, s.b_k ? CUBLAS_OP_T : CUBLAS_OP_N, s.a_k ? CUBLAS_OP_T : CUBLAS_OP_N, s.n, s.m, s.k, &one,
                     (float*)b, s.b_k ? sbn : sbk, (float*)a, s.a_k ? sam : sak, &zero, (float*)c, s.n));
    };
    CK(cuMemsetD8(c, 0, s.m * s.n * 4));
    double us = timed(cub);
    printf("%-16s m %5lld n %5lld k %5lld a%c b%c | cublas sgemm %8.1f us %5.1f TF/s err %.2e\n", s.name, s.m, s.n, s.k,
           s.a_k ? 'k' : 'm', s.b_k ? 'k' : 'n', us, flop / us * 1e-6, err());
    for (Variant& v : vs) {
      if (v.a_k != s.a_k || v.b_k != s.b_k) continue;
      GArgs g = {s.m, s.n, s.k, sam, sak, sbk, sbn, s.n, 0, 0};
      void* params[] = {&c, &a, &b, &c, &g};
      int threads = (v.bm / v.wm) * (v.bn / v.wn) * 32;
      int smem = v.stages * ((v.a_k ? v.bm * (v.bk + 4) : v.bk * (v.bm + 8)) + (v.b_k ? v.bn * (v.bk + 4) : v.bk * (v.bn + 8))) * 4;
      auto run = [&]() { CK(cuLaunchKernel(v.f, (s.n + v.bn - 1) / v.bn, (s.m + v.bm - 1) / v.bm, 1, threads, 1, 1, smem, 0, params, 0)); };
      CK(cuMemsetD8(c, 0xff, s.m * s.n * 4));
      double t = timed(run);
      printf("%-16s   %-44s %8.1f us %5.1f TF/s err %.2e (x%.2f vs cublas)\n", "", v.name.c_str(), t, flop / t * 1e-6, err(), us / t);
    }
    CK(cuMemFree(a)); CK(cuMemFree(b)); CK(cuMemFree(c));
  }
  return 0;
}
