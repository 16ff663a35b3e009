// Times Kiln's generated attention kernels (fwd, dq, dkv) outside Kiln, so that several
// variants can be compared in one run on the GPU machine (which has nvcc but no Rust).
// Each variant is a folder of fwd.cubin, dq.cubin, dkv.cubin: the sources that
// `cargo run --release -p kiln-tensor --example flash_sources -- DIR` writes (edited by hand
// for a variant), compiled with `nvcc -cubin -arch=sm_90`. Its argument style: "old" (dense,
// no Mat arguments: the kernels before session 12), "dense" or "strided" (q, k, v heads cut
// from one [B, T, 3 H D] buffer); then the dynamic shared memory per launch (36864 for the
// current kernels at D = 64). The first variant is the reference for the others' outputs.
// Shapes: the GPT benchmark's attention, B 64, H 6, T 256, D 64, causal, BF16.
//   nvcc -O2 -o attn_bench attn_bench.cpp -lcuda && ./attn_bench DIR:STYLE[:SMEM] ...
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
static std::vector<unsigned short> randn(long long n, unsigned long long seed) {
  std::vector<unsigned short> v(n);
  for (long long i = 0; i < n; ++i) { double u1 = lcg(seed) + 1e-12, u2 = lcg(seed); v[i] = f2b((float)(sqrt(-2 * log(u1)) * cos(6.283185307 * u2))); }
  return v;
}
static CUdeviceptr upload(const std::vector<unsigned short>& v) { CUdeviceptr p; CK(cuMemAlloc(&p, v.size() * 2)); CK(cuMemcpyHtoD(p, v.data(), v.size() * 2)); return p; }
static std::vector<float> download(CUdeviceptr p, long long n) { std::vector<unsigned short> h(n); CK(cuMemcpyDtoH(h.data(), p, n * 2)); std::vector<float> f(n); for (long long i = 0; i < n; ++i) f[i] = b2f(h[i]); return f; }
static double rel(const std::vector<float>& a, const std::vector<float>& r) {
  double num = 0, den = 0; bool nan = false;
  for (size_t i = 0; i < a.size(); ++i) { if (a[i] != a[i]) nan = true; num += (a[i] - r[i]) * (double)(a[i] - r[i]); den += (double)r[i] * r[i]; }
  return nan ? NAN : sqrt(num / den);
}
int main(int argc, char** argv) {
  CK(cuInit(0)); CUdevice dev; CK(cuDeviceGet(&dev, 0)); CUcontext ctx; CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  // Inputs: dense q, k, v, g and one fused qkv buffer holding the same values.
  auto hq = randn(N, 1), hk = randn(N, 2), hv = randn(N, 3), hg = randn(N, 4);
  std::vector<unsigned short> hqkv(3 * N);
  for (int b = 0; b < B; ++b) for (int h = 0; h < H; ++h) for (int t = 0; t < T; ++t) for (int d = 0; d < D; ++d) {
    long long src = (((long long)b * H + h) * T + t) * D + d, dst = ((long long)b * T + t) * 3 * H * D + h * D + d;
    hqkv[dst] = hq[src]; hqkv[dst + H * D] = hk[src]; hqkv[dst + 2 * H * D] = hv[src];
  }
  CUdeviceptr q = upload(hq), k = upload(hk), v = upload(hv), g = upload(hg), qkv = upload(hqkv);
  CUdeviceptr o, dq, dkv, stats; CK(cuMemAlloc(&o, N * 2)); CK(cuMemAlloc(&dq, N * 2)); CK(cuMemAlloc(&dkv, 2 * N * 2)); CK(cuMemAlloc(&stats, (long long)B * H * T * 8));
  long long Tn = T; float scale = 0.125f;
  std::vector<std::vector<float>> ref;
  CUevent e0, e1; CK(cuEventCreate(&e0, 0)); CK(cuEventCreate(&e1, 0));
  for (int a = 1; a < argc; ++a) {
    // DIR:STYLE[:SMEM], SMEM the dynamic shared memory bytes of each launch (0 by default).
    std::string spec = argv[a]; size_t c = spec.find(':'), c2 = spec.find(':', c + 1);
    std::string dir = spec.substr(0, c), style = spec.substr(c + 1, c2 == std::string::npos ? std::string::npos : c2 - c - 1);
    unsigned smem = c2 == std::string::npos ? 0 : atoi(spec.c_str() + c2 + 1);
    bool old = style == "old", strided = style == "strided";
    Mat dense = {T * D, 0, D, 1}, sm = {(long long)T * 3 * H * D, D, 3 * H * D, H};
    Mat mq = strided ? sm : dense, mk = mq, mv = mq, mo = dense, mg = dense;
    CUdeviceptr pq = strided ? qkv : q, pk = strided ? qkv + H * D * 2 : k, pv = strided ? qkv + 2 * H * D * 2 : v;
    CUdeviceptr dk = dkv, dv = dkv + N * 2;
    double times[3];
    std::vector<std::vector<float>> outs;
    const char* names[3] = {"fwd", "dq", "dkv"};
    for (int kind = 0; kind < 3; ++kind) {
      CUmodule m; CK(cuModuleLoad(&m, (dir + "/" + names[kind] + ".cubin").c_str()));
      CUfunction f; char fname[128]; snprintf(fname, sizeof fname, "k_flash_%s_bf16_d64_causal", names[kind]); CK(cuModuleGetFunction(&f, m, fname));
      if (smem > 48 * 1024) CK(cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem));
      std::vector<void*> p;
      if (kind == 0) { p = {&o, &pq, &pk, &pv}; if (!old) { p.push_back(&mq); p.push_back(&mk); p.push_back(&mv); } }
      if (kind == 1) { p = {&dq, &stats, &pq, &pk, &pv, &o, &g}; if (!old) { p.push_back(&mq); p.push_back(&mk); p.push_back(&mv); p.push_back(&mo); p.push_back(&mg); } }
      if (kind == 2) { p = {&dk, &dv, &stats, &pq, &pk, &pv, &g}; if (!old) { p.push_back(&mq); p.push_back(&mk); p.push_back(&mv); p.push_back(&mg); } }
      p.push_back(&Tn); p.push_back(&scale);
      auto launch = [&] { CK(cuLaunchKernel(f, T / 64, B * H, 1, 128, 1, 1, smem, 0, p.data(), 0)); };
      launch(); CK(cuCtxSynchronize());
      std::vector<float> ts;
      for (int r = 0; r < 30; ++r) { CK(cuEventRecord(e0, 0)); launch(); CK(cuEventRecord(e1, 0)); CK(cuEventSynchronize(e1)); float ms; CK(cuEventElapsedTime(&ms, e0, e1)); ts.push_back(ms * 1000); }
      std::sort(ts.begin(), ts.end()); times[kind] = ts[ts.size() / 2];
      if (kind == 0) outs.push_back(download(o, N));
      if (kind == 1) outs.push_back(download(dq, N));
      if (kind == 2) outs.push_back(download(dkv, 2 * N));
      CK(cuModuleUnload(m));
    }
    if (ref.empty()) ref = outs;
    printf("%-30s fwd %7.1f us  dq %7.1f us  dkv %7.1f us  | rel err vs first: o %.2e dq %.2e dkv %.2e\n", spec.c_str(), times[0], times[1], times[2], rel(outs[0], ref[0]), rel(outs[1], ref[1]), rel(outs[2], ref[2]));
  }
  return 0;
}
