// The floor under a small compiled step: a CUDA graph of N empty kernels (one block of 32
// threads each, in a chain on one stream), launched and waited for as `bench_gpu` times a
// `ReduceOverhead` step (host call to device completion, `cudaStreamSynchronize` after).
// Prints the median and 10th/90th percentiles of 2000 replays for N = 1, 3, 6, 12, 30.
//   nvcc -O2 -arch=sm_90 -o launch_floor launch_floor.cu && ./launch_floor
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#define CK(x)                                                                  \
  do {                                                                         \
    cudaError_t e_ = (x);                                                      \
    if (e_ != cudaSuccess) {                                                   \
      printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      return 1;                                                                \
    }                                                                          \
  } while (0)

__global__ void empty(int* p) {
  if (p && threadIdx.x == 0) *p += 1;
}

int main() {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int* counter;
  CK(cudaMalloc(&counter, sizeof(int)));
  for (int n : {1, 3, 6, 12, 30}) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < n; ++i) empty<<<1, 32, 0, s>>>(counter);
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    std::vector<double> us;
    for (int i = 0; i < 2200; ++i) {
      CK(cudaStreamSynchronize(s));
      auto t = std::chrono::steady_clock::now();
      CK(cudaGraphLaunch(exec, s));
      CK(cudaStreamSynchronize(s));
      double dt = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count();
      if (i >= 200) us.push_back(dt);
    }
    std::sort(us.begin(), us.end());
    printf("graph of %2d empty kernels: median %.1f us (p10 %.1f, p90 %.1f)\n", n, us[us.size() / 2], us[us.size() / 10],
           us[us.size() * 9 / 10]);
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
  }
  return 0;
}
