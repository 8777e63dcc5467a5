// The ceiling of `mma.sync.m16n8k16` (f32 accumulation) on the device: every
// warp of every block issues independent multiply-accumulates on registers
// only, no memory traffic, so the figure is what the instruction itself can
// do on this chip. `bench gpu`'s mma.sync kernel is measured against it (on
// Hopper, cuBLAS uses wgmma, which this instruction cannot reach).
// Built and run on the GPU machine by `scripts/gpu_device.sh run`:
//   nvcc -O3 -arch=sm_XX -o mma_peak scripts/mma_peak.cu && ./mma_peak
#ifndef __CUDACC_RTC__  // NVRTC (the CPU machine's syntax check) has no host API
#include <cstdio>
#include <cuda_runtime.h>
#endif

// CHAINS independent accumulator fragments per warp: enough in flight to
// cover the instruction's latency.
constexpr int CHAINS = 8;

template <bool BF16>
__global__ void __launch_bounds__(256) peak(float* out, int iters) {
    const unsigned t = threadIdx.x + 1;
    // Small normal values in both halves of each register (no NaN/Inf).
    const unsigned one = BF16 ? 0x3f803f80u : 0x3c003c00u;
    const unsigned a0 = one, a1 = one ^ (t & 1), a2 = one, a3 = one ^ (t & 2);
    const unsigned b0 = one, b1 = one ^ (t & 4);
    float c[CHAINS][4] = {};
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int j = 0; j < CHAINS; ++j) {
            if (BF16) {
                asm volatile(
                    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                    "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                    : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                    : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
            } else {
                asm volatile(
                    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                    "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                    : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                    : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
            }
        }
    }
    float s = 0.0f;
    for (int j = 0; j < CHAINS; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;  // keeps the work alive
}

#ifdef __CUDACC_RTC__
template __global__ void peak<true>(float*, int);
template __global__ void peak<false>(float*, int);
#else
template <bool BF16>
static double tflops(int sms, float* out) {
    const int blocks = sms * 4, threads = 256, iters = 1 << 14;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    peak<BF16><<<blocks, threads>>>(out, 64);  // warm-up
    float best = 1e30f;
    for (int r = 0; r < 5; ++r) {
        cudaEventRecord(e0);
        peak<BF16><<<blocks, threads>>>(out, iters);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float ms = 0.0f;
        cudaEventElapsedTime(&ms, e0, e1);
        if (ms < best) best = ms;
    }
    const double flops = 2.0 * 16 * 8 * 16 * CHAINS * (double)iters * (blocks * threads / 32);
    return flops / (best * 1e-3) / 1e12;
}

int main() {
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) {
        fprintf(stderr, "mma_peak: no CUDA device\n");
        return 1;
    }
    float* out;
    cudaMalloc(&out, (size_t)p.multiProcessorCount * 4 * 256 * sizeof(float));
    const double bf = tflops<true>(p.multiProcessorCount, out);
    const double hf = tflops<false>(p.multiProcessorCount, out);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        fprintf(stderr, "mma_peak: %s\n", cudaGetErrorString(e));
        return 1;
    }
    printf("{\"bench\":\"mma_peak\",\"device\":\"%s\",\"sms\":%d,\"bf16_tflops\":%.1f,\"f16_tflops\":%.1f}\n",
           p.name, p.multiProcessorCount, bf, hf);
    return 0;
}
#endif
