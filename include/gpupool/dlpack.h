/*
 * DLPack export of gpupool buffers.
 *
 * This header carries the DLPack ABI v1.x types (DLPackVersion, DLDevice, DLDataType,
 * DLTensor, DLManagedTensor, DLManagedTensorVersioned), written from the public DLPack
 * specification, so that a C or C++ program can hand a gpupool buffer to any framework that
 * imports DLPack (PyTorch, CuPy, JAX, NumPy, TVM, ...) without a copy. When the official
 * dlpack/dlpack.h (v1.0 or later) was included first, its definitions are used instead; the
 * layouts are the same. Including the official header after this one is harmless: this
 * header claims its include guard.
 *
 * Ownership: the two export functions take over the caller's hold. The returned object's
 * deleter releases that hold (gpupool_release(b, NULL)) exactly once and frees the shape and
 * strides storage; the caller must not use or release b after a successful call. On failure
 * b is untouched and still owned by the caller.
 */
#ifndef GPUPOOL_DLPACK_H
#define GPUPOOL_DLPACK_H

#include <stddef.h>
#include <stdint.h>

#include "gpupool/gpupool.h"

#if defined(DLPACK_DLPACK_H_) && !defined(DLPACK_MAJOR_VERSION)
/* A pre-1.0 dlpack.h lacks DLManagedTensorVersioned; mixing it with ours would redefine its
 * structs. */
#error "gpupool/dlpack.h needs DLPack >= 1.0: include a newer dlpack/dlpack.h or none at all"
#endif

#if !defined(DLPACK_MAJOR_VERSION) && !defined(DLPACK_VERSION_MAJOR)
#define DLPACK_DLPACK_H_

#define DLPACK_MAJOR_VERSION 1
#define DLPACK_MINOR_VERSION 1

#ifdef __cplusplus
#define DLPACK_EXTERN_C extern "C"
#else
#define DLPACK_EXTERN_C
#endif
#define DLPACK_DLL

#ifdef __cplusplus
extern "C" {
#endif

/* Version of the DLPack ABI a DLManagedTensorVersioned follows. A consumer accepts any
 * minor version of a major version it knows. */
typedef struct {
  uint32_t major;
  uint32_t minor;
} DLPackVersion;

/* Where the memory of a tensor lives. */
#ifdef __cplusplus
typedef enum : int32_t {
#else
typedef enum {
#endif
  kDLCPU = 1,          /* plain host memory */
  kDLCUDA = 2,         /* CUDA device memory */
  kDLCUDAHost = 3,     /* pinned host memory allocated or registered through CUDA */
  kDLOpenCL = 4,
  kDLVulkan = 7,
  kDLMetal = 8,
  kDLVPI = 9,
  kDLROCM = 10,
  kDLROCMHost = 11,
  kDLExtDev = 12,
  kDLCUDAManaged = 13, /* CUDA managed (unified) memory */
  kDLOneAPI = 14,
  kDLWebGPU = 15,
  kDLHexagon = 16,
  kDLMAIA = 17
} DLDeviceType;

/* A device: its type and its ordinal among devices of that type (0 for the host). */
typedef struct {
  DLDeviceType device_type;
  int32_t device_id;
} DLDevice;

/* Element type codes. */
typedef enum {
  kDLInt = 0U,
  kDLUInt = 1U,
  kDLFloat = 2U,
  kDLOpaqueHandle = 3U,
  kDLBfloat = 4U,
  kDLComplex = 5U,
  kDLBool = 6U,
  kDLFloat8_e3m4 = 7U,
  kDLFloat8_e4m3 = 8U,
  kDLFloat8_e4m3b11fnuz = 9U,
  kDLFloat8_e4m3fn = 10U,
  kDLFloat8_e4m3fnuz = 11U,
  kDLFloat8_e5m2 = 12U,
  kDLFloat8_e5m2fnuz = 13U,
  kDLFloat8_e8m0fnu = 14U,
  kDLFloat6_e2m3fn = 15U,
  kDLFloat6_e3m2fn = 16U,
  kDLFloat4_e2m1fn = 17U
} DLDataTypeCode;

/* Element type: code (DLDataTypeCode), bits per lane, lanes per element (1 for scalars).
 * bool is {kDLBool, 8, 1}; complex64 is {kDLComplex, 64, 1}. */
typedef struct {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} DLDataType;

/* A strided view of memory. data + byte_offset is element 0; shape and strides (in
 * elements, NULL = C-contiguous) have ndim entries each. */
typedef struct {
  void *data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape;
  int64_t *strides;
  uint64_t byte_offset;
} DLTensor;

/* The pre-1.0 exchange object: no version, no flags. The consumer calls deleter(self) once
 * when it no longer needs the memory. */
typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

/* The memory must not be written through this tensor. */
#define DLPACK_FLAG_BITMASK_READ_ONLY (1UL << 0)
/* The producer made a copy for this export; the consumer owns it alone. */
#define DLPACK_FLAG_BITMASK_IS_COPIED (1UL << 1)
/* Sub-byte element types are padded to whole bytes (DLPack 1.1). */
#define DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED (1UL << 2)

/* The versioned exchange object (DLPack >= 1.0). */
typedef struct DLManagedTensorVersioned {
  DLPackVersion version;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned *self);
  uint64_t flags;
  DLTensor dl_tensor;
} DLManagedTensorVersioned;

#ifdef __cplusplus
}
#endif

#endif /* no official dlpack.h */

#ifdef __cplusplus
extern "C" {
#endif

/* Describe the buffer held by b as a DLPack tensor and hand the hold to it. The tensor is
 * the one b was published with (gpupool_buffer_tensor()), or a 1-D uint8 tensor of
 * gpupool_buffer_size(b) bytes when it has none. Device: kDLCUDA with the buffer's device
 * for device memory, kDLCUDAHost for pinned HOST_NUMA memory, kDLCPU for memfd host memory.
 * flags has DLPACK_FLAG_BITMASK_READ_ONLY when the hold is read-only. data points at
 * element 0 (byte_offset is 0), strides are always present.
 * Returns 0 and *out (the caller owns it: call (*out)->deleter(*out) when done, or hand it
 * to a framework that will), GPUPOOL_EINVAL for NULL arguments, GPUPOOL_EMETA when the
 * description cannot be expressed or does not fit in the buffer, GPUPOOL_ENOMEM. */
GPUPOOL_EXTERN int gpupool_buffer_to_dlpack_versioned(gpupool_buffer *b,
                                                      DLManagedTensorVersioned **out);

/* The same as a pre-1.0 DLManagedTensor, for consumers that do not know the versioned form.
 * That form cannot say "read-only", so a read-only hold is refused with GPUPOOL_ERDONLY
 * rather than handed out as writable memory. */
GPUPOOL_EXTERN int gpupool_buffer_to_dlpack(gpupool_buffer *b, DLManagedTensor **out);

#ifdef __cplusplus
}
#endif

#endif /* GPUPOOL_DLPACK_H */
