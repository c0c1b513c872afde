// KVTIER_HOST_DEVICE marks functions callable from both host code and CUDA kernels, so
// headers shared by the CPU reference and the CUDA backend need no CUDA includes.
#ifndef KVTIER_HOST_DEVICE_H_
#define KVTIER_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define KVTIER_HOST_DEVICE __host__ __device__
#else
#define KVTIER_HOST_DEVICE
#endif

#endif  // KVTIER_HOST_DEVICE_H_
