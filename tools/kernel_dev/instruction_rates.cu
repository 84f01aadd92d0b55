// The softmax's building blocks on this GPU: results per clock per SM of each instruction, 1,024 threads per SM
// each running 8 independent chains (so the unit's throughput shows, not its latency). Conversions feed their result
// back through one LOP3 (an integer op, on another pipe). Compares against the FMA rate in the same run.
//
// Why it is here: the FP8-compute prefill kernel is bound by its softmax (docs/design/prefill-kernel.md). Its
// exponentials run on MUFU; FlashAttention-4 moves part of them to a cubic on the FMA pipe, which pays on Blackwell.
// On an H200 the cubic (8 instructions) yields fewer results per clock than MUFU itself, and the kernel slowed by
// 4-13% with 2-4 of every 8 exponentials moved.
//
//     nvcc -arch=sm_90a -O3 -o /tmp/instruction_rates tools/kernel_dev/instruction_rates.cu && /tmp/instruction_rates
#include <cstdio>
#include <cuda_fp16.h>
typedef unsigned u32;
#define N 8
template <int OP>
__global__ void k(float* out, int iters, long long* cycles) {
  float x[N];
  u32 r[N];
  for (int i = 0; i < N; ++i) { x[i] = -1.f - 0.001f * (threadIdx.x + i); r[i] = __float_as_uint(x[i]); }
  __syncthreads();
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (OP == 0) { asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+f"(x[i])); }
      if (OP == 1) { asm volatile("ex2.approx.f16x2 %0, %0;" : "+r"(r[i])); }
      if (OP == 2) { asm volatile("ex2.approx.ftz.bf16x2 %0, %0;" : "+r"(r[i])); }
      if (OP == 3) {
        u32 o;
        asm volatile("{.reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, %1, %1; mov.b32 %0, {t, t};}"
                     : "=r"(o) : "f"(__uint_as_float(r[i])));
        r[i] = o ^ 0x3f800000u;
      }
      if (OP == 4) {
        u32 o;
        asm volatile("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(o) : "f"(__uint_as_float(r[i])));
        r[i] = o ^ 0x3f800000u;
      }
      if (OP == 5) {
        u32 o;
        asm volatile("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(o) : "f"(__uint_as_float(r[i])));
        r[i] = o ^ 0x3f800000u;
      }
      if (OP == 6) {
        u32 o;
        asm volatile("{.reg .b16 t; cvt.rn.satfinite.e4m3x2.f16x2 t, %1; mov.b32 %0, {t, t};}" : "=r"(o) : "r"(r[i]));
        r[i] = o ^ 0x3c003c00u;
      }
      if (OP == 7) { asm volatile("fma.rn.f32 %0, %0, %0, %0;" : "+f"(x[i])); }
      if (OP == 8) {
        // 2^x on the FMA pipe: round to an integer k (the 1.5 x 2^23 trick), a cubic in the fraction, k into
        // the exponent bits
        float v = fmaxf(x[i], -127.f);
        float j = v + 12582912.f;
        float f = v - (j - 12582912.f);
        float p = fmaf(fmaf(fmaf(0.0555041086648216f, f, 0.2402264923172000f), f, 0.6931471805599453f), f, 1.f);
        x[i] = __uint_as_float(__float_as_uint(p) + (__float_as_uint(j) << 23)) - 2.f;
        asm volatile("" : "+f"(x[i]));
      }
      if (OP == 9) { asm volatile("max.f32 %0, %0, %1;" : "+f"(x[i]) : "f"(x[(i + 1) % N])); }
      if (OP == 10) { asm volatile("add.f32 %0, %0, %1;" : "+f"(x[i]) : "f"(x[(i + 1) % N])); }
    }
  }
  long long t1 = clock64();
  float s = 0;
  for (int i = 0; i < N; ++i) s += x[i] + __uint_as_float(r[i]);
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}
template <int OP>
void run(const char* name, double per_op) {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out; long long* cyc; cudaMalloc(&out, sms * 1024 * 4); cudaMalloc(&cyc, sms * 8);
  const int iters = 4096;
  k<OP><<<sms, 1024>>>(out, iters, cyc);
  k<OP><<<sms, 1024>>>(out, iters, cyc);
  cudaDeviceSynchronize();
  long long c[1024]; cudaMemcpy(c, cyc, sms * 8, cudaMemcpyDeviceToHost);
  long long mx = 0; for (int i = 0; i < sms; ++i) mx = c[i] > mx ? c[i] : mx;
  printf("| %s | %.1f |\n", name, 1024.0 * iters * N * per_op / mx);
  cudaFree(out); cudaFree(cyc);
}
int main() {
  printf("| op | results per clock per SM |\n|---|---|\n");
  run<7>("fma.rn.f32", 1); run<9>("max.f32", 1); run<10>("add.f32", 1);
  run<0>("ex2.approx.ftz.f32", 1); run<1>("ex2.approx.f16x2", 2); run<2>("ex2.approx.ftz.bf16x2", 2);
  run<3>("cvt.rn.satfinite.e4m3x2.f32 (+lop)", 2); run<4>("cvt.rn.bf16x2.f32 (+lop)", 2);
  run<5>("cvt.rn.f16x2.f32 (+lop)", 2); run<6>("cvt.rn.satfinite.e4m3x2.f16x2 (+lop)", 2);
  run<8>("exp2 polynomial on FMA/ALU (+fadd)", 1);
  return 0;
}
