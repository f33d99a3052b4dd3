/* KERNEL_CLONES: a loop function compiled three times (AVX-512, AVX2, baseline x86-64), the copy for the
 * CPU picked once at load time (an ifunc).  For loops whose result does not depend on the vector width:
 * elementwise IEEE operations, integer tests, sums over independent lanes.  GCC on x86-64 only; not
 * under ThreadSanitizer, whose runtime is not up yet when the ifunc resolver runs. */
#ifndef DILOCO_KERNEL_CLONES_H
#define DILOCO_KERNEL_CLONES_H

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define KERNEL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KERNEL_CLONES
#endif

#endif
