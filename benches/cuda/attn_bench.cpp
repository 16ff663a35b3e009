// Times Kiln's generated attention kernels (fwd, dq, dkv) outside Kiln, so that several
// variants can be compared in one run on the GPU machine (which has nvcc but no Rust).
// Each variant is a folder of fwd.cubin, dq.cubin, dkv.cubin: the sources that
// `cargo run --release -p kiln-tensor --example flash_sources -- DIR [bf16|f32]` writes
// (edited by hand for a variant), compiled with `nvcc -cubin -arch=sm_90`. Its argument style:
// "old" (dense, no Mat arguments: the kernels before session 12), "dense" or "strided" (q, k,
// v heads cut from one [B, T, 3 H D] buffer; sessions 12-30), or "lse-dense" / "lse-strided"
// (since session 31: the forward writes each row's log-sum-exp, dq reads it, and the grid is
// (matrix, row block)); then the dynamic shared memory per launch (36864
// for the BF16 kernels at D = 64, 69632 for the F32 ones), then the dtype (bf16 or f32). The
// first variant of each dtype is the reference for the others' outputs.
// Shapes: the GPT benchmark's attention, B 64, H 6, T 256, D 64, causal.
//   nvcc -O2 -o attn_bench attn_bench.cpp -lcuda && ./attn_bench DIR:STYLE[:SMEM[:DTYPE]] ...
#include <cuda.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include <string>
#include <algorithm>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char* s; cuGetErrorString(r_, &s); printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); exit(1); } } while (0)
struct Mat { long long b, h, t, nh; };
static const int B = 64, H = 6, T = 256, D = 64;
static const long long N = (long long)B * H * T * D;
static unsigned short f2b(float f) { unsigned u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return u >> 16; }
static float b2f(unsigned short b) { unsigned u = (unsigned)b << 16; float f; memcpy(&f, &u, 4); return f; }
static double lcg(unsigned long long& s) { s = s * 6364136223846793005ULL + 1442695040888963407ULL; return ((s >> 11) * (1.0 / 9007199254740992.0)); }
// Values rounded to BF16, so that both dtypes see the same inputs.
static std::vector<float> randn(long long n, unsigned long long seed) {
  std::vector<float> v(n);
  for (long long i = 0; i < n; ++i) { double u1 = lcg(seed) + 1e-12, u2 = lcg(seed); v[i] = b2f(f2b((float)(sqrt(-2 * log(u1)) * cos(6.283185307 * u2)))); }
  return v;
}
// es: the element size, 2 (bf16) or 4 (f32).
static CUdeviceptr upload(const std::vector<float>& v, int es) {
  CUdeviceptr p; CK(cuMemAlloc(&p, v.size() * es));
  if (es == 4) { CK(cuMemcpyHtoD(p, v.data(), v.size() * 4)); return p; }
  std::vector<unsigned short> h(v.size()); for (size_t i = 0; i < v.size(); ++i) h[i] = f2b(v[i]);
  CK(cuMemcpyHtoD(p, h.data(), h.size() * 2)); return p;
}
static std::vector<float> download(CUdeviceptr p, long long n, int es) {
  std::vector<float> f(n);
  if (es == 4) { CK(cuMemcpyDtoH(f.data(), p, n * 4)); return f; }
  std::vector<unsigned short> h(n); CK(cuMemcpyDtoH(h.data(), p, n * 2)); for (long long i = 0; i < n; ++i) f[i] = b2f(h[i]); return f;
}
static double rel(const std::vector<float>& a, const std::vector<float>& r) {
  double num = 0, den = 0; bool nan = false;
  for (size_t i = 0; i < a.size(); ++i) { if (a[i] != a[i]) nan = true; num += (a[i] - r[i]) * (double)(a[i] - r[i]); den += (double)r[i] * r[i]; }
  return nan ? NAN : sqrt(num / den);
}
int main(int argc, char** argv) {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  // Inputs: dense q, k, v, g and one fused qkv buffer holding the same values.
  auto hq = randn(N, 1), hk = randn(N, 2), hv = randn(N, 3), hg = randn(N, 4);
  std::vector<float> hqkv(3 * N);
  for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) for (int t = 0; t < T; ++t) for (int d = 0; d < D; ++d) {
    long long src = (((long long)b * H + h) * T + t) * D + d, dst = ((long long)b * T + t) * 3 * H * D + h * D + d;
    hqkv[dst] = hq[src]; hqkv[dst + H * D] = hk[src]; hqkv[dst + 2 * H * D] = hv[src];
  }
  CUdeviceptr o, dq, dkv, stats, lse; CK(cuMemAlloc(&o, N * 4)); CK(cuMemAlloc(&dq, N * 4)); CK(cuMemAlloc(&dkv, 2 * N * 4)); CK(cuMemAlloc(&stats, (long long)B * H * T * 8));
  CK(cuMemAlloc(&lse, (long long)B * H * T * 4));
  long long Tn = T; float scale = 0.125f;
  std::vector<std::vector<float>> ref[2];
  CUevent e0, e1; CK(cuEventCreate(&e0, 0)); CK(cuEventCreate(&e1, 0));
  for (int a = 1; a < argc; ++a) {
    // DIR:STYLE[:SMEM[:DTYPE]], SMEM the dynamic shared memory bytes of each launch (0 by default).
    std::string spec = argv[a]; size_t c = spec.find(':'), c2 = spec.find(':', c + 1), c3 = c2 == std::string::npos ? c2 : spec.find(':', c2 + 1);
    std::string dir = spec.substr(0, c), style = spec.substr(c + 1, c2 == std::string::npos ? std::string::npos : c2 - c - 1);
    unsigned smem = c2 == std::string::npos ? 0 : atoi(spec.c_str() + c2 + 1);
    const bool f32 = c3 != std::string::npos && spec.substr(c3 + 1) == "f32";
    const int es = f32 ? 4 : 2;
    CUdeviceptr q = upload(hq, es), k = upload(hk, es), v = upload(hv, es), g = upload(hg, es), qkv = upload(hqkv, es);
    const bool with_lse = style.rfind("lse-", 0) == 0;
    if (with_lse) style = style.substr(4);
    bool old = style == "old", strided = style == "strided";
    Mat dense = {T * D, 0, D, 1}, sm = {(long long)T * 3 * H * D, D, 3 * H * D, H};
    Mat mq = strided ? sm : dense, mk = mq, mv = mq, mo = dense, mg = dense, mout = dense;
    CUdeviceptr pq = strided ? qkv : q, pk = strided ? qkv + H * D * es : k, pv = strided ? qkv + 2 * H * D * es : v;
    CUdeviceptr dk = dkv, dv = dkv + N * es;
    double times[3];
    std::vector<std::vector<float>> outs;
    const char* names[3] = {"fwd", "dq", "dkv"};
    for (int kind = 0; kind < 3; ++kind) {
      CUmodule m; CK(cuModuleLoad(&m, (dir + "/" + names[kind] + ".cubin").c_str()));
      CUfunction f; char fname[128]; snprintf(fname, sizeof fname, "k_flash_%s_%s_d64_causal", names[kind], f32 ? "f32" : "bf16"); CK(cuModuleGetFunction(&f, m, fname));
      if (smem > 48 * 1024) CK(cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem));
      std::vector<void*> p;
      if (kind == 0) { p = {&o, &pq, &pk, &pv}; if (with_lse) p.insert(p.begin() + 1, &lse); if (!old) { p.push_back(&mq); p.push_back(&mk); p.push_back(&mv); p.push_back(&mout); } }
      if (kind == 1) { p = {&dq, &stats, &pq, &pk, &pv, &o, &g}; if (with_lse) p.insert(p.begin() + 2, &lse); if (!old) { p.push_back(&mq); p.push_back(&mk); p.push_back(&mv); p.push_back(&mo); p.push_back(&mg); p.push_back(&mout); } }
      if (kind == 2) { p = {&dk, &dv, &stats, &pq, &pk, &pv, &g}; if (!old) { p.push_back(&mq); p.push_back(&mk); p.push_back(&mv); p.push_back(&mg); p.push_back(&mout); } }
      p.push_back(&Tn); p.push_back(&scale);
      const unsigned gx = with_lse ? B * H : T / 64, gy = with_lse ? T / 64 : B * H;
      auto launch = [&] { CK(cuLaunchKernel(f, gx, gy, 1, 128, 1, 1, smem, 0, p.data(), 0)); };
      launch(); CK(cuCtxSynchronize());
      std::vector<float> ts;
      for (int r = 0; r < 30; ++r) { CK(cuEventRecord(e0, 0)); launch(); CK(cuEventRecord(e1, 0)); CK(cuEventSynchronize(e1)); float ms; CK(cuEventElapsedTime(&ms, e0, e1)); ts.push_back(ms * 1000); }
      std::sort(ts.begin(), ts.end()); times[kind] = ts[ts.size() / 2];
      if (kind == 0) outs.push_back(download(o, N, es));
      if (kind == 1) outs.push_back(download(dq, N, es));
      if (kind == 2) outs.push_back(download(dkv, 2 * N, es));
      CK(cuModuleUnload(m));
    }
    auto& r = ref[f32];
    if (r.empty()) r = outs;
    printf("%-30s fwd %7.1f us  dq %7.1f us  dkv %7.1f us  | rel err vs first: o %.2e dq %.2e dkv %.2e\n", spec.c_str(), times[0], times[1], times[2], rel(outs[0], r[0]), rel(outs[1], r[1]), rel(outs[2], r[2]));
    for (CUdeviceptr p : {q, k, v, g, qkv}) CK(cuMemFree(p));
  }
  return 0;
}
