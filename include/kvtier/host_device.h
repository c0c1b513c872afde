// KVTIER_HOST_DEVICE marks functions callable from both host code and CUDA kernels, so
// headers shared by the CPU reference and the CUDA backend need no CUDA includes.
#ifndef KVTIER_HOST_DEVICE_H_
#define KVTIER_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define KVTIER_HOST_DEVICE __host__ __device__
#else
#define KVTIER_HOST_DEVICE
#endif

// KVTIER_FORCE_INLINE: always inlined, on host and device. Small hot helpers (dtype
// conversions) use it so they inherit the instruction set of whatever calls them, which
// multi-versioned CPU kernels rely on.
#if defined(__CUDACC__)
#define KVTIER_FORCE_INLINE __forceinline__
#elif defined(__GNUC__)
#define KVTIER_FORCE_INLINE [[gnu::always_inline]] inline
#else
#define KVTIER_FORCE_INLINE inline
#endif

#endif  // KVTIER_HOST_DEVICE_H_
