/*
 * gpupool client API.
 *
 * Every function is gpupool_<object>_<verb>. The functions, by object (each is declared
 * below with what it owns and frees):
 *
 *   errors and version
 *     gpupool_err_name, gpupool_strerror   name and one-line description of an error code
 *     gpupool_last_error                   the calling thread's last failure, in full
 *     gpupool_version_string               "MAJOR.MINOR.PATCH" of the library
 *   client (a connection to gpupoold)
 *     gpupool_client_default_socket_path   the socket path used when none is given
 *     gpupool_client_connect               connect and handshake: a new client
 *     gpupool_client_disconnect            release everything held, close, free
 *     gpupool_client_set_connect_timeout   the limit reconnections use
 *     gpupool_client_set_reconnect         how long a request may spend reconnecting
 *     gpupool_client_reconnect_count       how many times the client reconnected
 *     gpupool_client_slab_maps             how many slabs the client mapped (imports)
 *     gpupool_client_ready_waits           how many ready events the client's streams waited on
 *     gpupool_client_nowait_failures       how many shares not waited for failed, and why
 *     gpupool_client_lost_names            names lost when the daemon went away
 *     gpupool_client_host_fences           whether GPU work is ordered by host-side fences
 *     gpupool_client_set_devices           the CUDA devices this process touches memory from
 *     gpupool_client_stats_sized           daemon and pool counters (gpupool_client_stats)
 *     gpupool_client_trim                  ask the daemon to return unused slabs
 *   buffer (a hold on a range of pool memory)
 *     gpupool_buffer_alloc                 allocate: a new hold
 *     gpupool_buffer_release               drop a hold and free its handle
 *     gpupool_buffer_share                 a token another client opens
 *     gpupool_buffer_share_kept            the same, alive without this hold until opened once
 *     gpupool_buffer_open                  open a token: a new hold
 *     gpupool_buffer_alloc_many            allocate many buffers, their requests in flight together
 *     gpupool_buffer_share_kept_many       kept shares of many buffers in one request
 *     gpupool_buffer_share_kept_many_nowait the same, not waiting for the daemon's reply
 *     gpupool_buffer_open_many             open many tokens in one request
 *     gpupool_buffer_idle_many             which buffers only the caller references now
 *     gpupool_buffer_release_many          drop many holds in one request
 *     gpupool_buffer_publish               publish under a name (its next version)
 *     gpupool_buffer_publish_to            the same, with replicas on other devices at once
 *     gpupool_buffer_get                   get what a name holds, now or a newer version
 *     gpupool_buffer_get_begin, _get_end   the same get, pipelined
 *     gpupool_buffer_publish_begin         the same publish, pipelined (gpupool_pending_end)
 *     gpupool_buffer_release_begin         the same release, pipelined (gpupool_pending_end)
 *     gpupool_buffer_idle_many_begin, _end whether buffers are idle (gpupool_buffer_idle_many), pipelined
 *     gpupool_buffer_ptr, _size, _device, _kind, _id, _read_only, _tensor, _client, _lost
 *                                          what a buffer is
 *   name (a published name)
 *     gpupool_name_unpublish               remove a name
 *   file (a published read-only file range)
 *     gpupool_file_publish                 publish a file range under a name
 *     gpupool_file_get                     map the file a name holds
 *     gpupool_file_release                 unmap and free
 *     gpupool_file_ptr, _device_ptr, _size, _info_get
 *                                          what a mapping is
 *   bundle (a named set of members: a state dict, a batch)
 *     gpupool_bundle_alloc                 allocate members in one request
 *     gpupool_bundle_publish               publish a bundle got from alloc or get
 *     gpupool_bundle_publish_to            the same, with replicas on other devices at once
 *     gpupool_bundle_publish_members       publish ranges of buffers the caller holds
 *     gpupool_bundle_get                   get what a name holds, as a bundle
 *     gpupool_bundle_get_begin, _get_end   the same get, pipelined
 *     gpupool_bundle_release               drop its holds and free it
 *     gpupool_bundle_count, _version, _member, _members, _layout_id, _find, _buffers, _buffer
 *                                          what a bundle is
 *   pending (a pipelined request)
 *     gpupool_pending_end                  wait for a publish or release begun
 *     gpupool_pending_cancel               forget a request begun, undoing what it brings
 *   tensor
 *     gpupool_tensor_span                  bytes a tensor description spans
 *
 * A process links libgpupool-client, connects to gpupoold over its Unix socket, and then
 * allocates, shares, publishes and gets buffers that live in pools the daemon owns (CUDA
 * device pools or memfd-backed host pools). Memory is mapped into the process once per slab
 * and handed out as (slab, offset, size); it goes back to the pool only after every holder
 * (owner, openers, a published name) has let go. The connection is the lease: when a process
 * exits or dies, every hold it had is dropped.
 *
 * Errors: every function that can fail returns 0 or a negative GPUPOOL_E* code.
 * gpupool_strerror() names the code; gpupool_last_error() returns the full message of the
 * calling thread's last failure (often the daemon's explanation, with the cause and the fix).
 *
 * Threads: a gpupool_client may be used from several threads at once. Requests from
 * different threads are multiplexed over the one connection; a thread blocked in
 * gpupool_buffer_get() or a waiting gpupool_buffer_alloc() does not stop other threads' requests.
 * A gpupool_buffer must not be released by one thread while another still uses it.
 *
 * Streams: `stream` arguments are a cudaStream_t passed as void* (NULL = the legacy default
 * stream). On the host backend they are ignored. On the CUDA backend the memory of a returned
 * buffer is safe to use in that stream (the stream waits on the producer's ready event and on
 * the previous holders' done events; the CPU does not block), and release frees in stream
 * order.
 */
#ifndef GPUPOOL_GPUPOOL_H
#define GPUPOOL_GPUPOOL_H

#include <stddef.h>
#include <stdint.h>

#include "gpupool/version.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(GPUPOOL_STATIC)
#define GPUPOOL_EXTERN
#else
#define GPUPOOL_EXTERN __attribute__((visibility("default")))
#endif

/* Error codes: one list generates the enum and gpupool_strerror()/gpupool_err_name(). */
#define GPUPOOL_ERRNO_MAP(X)                                                                \
  X(EINVAL, -1, "invalid argument")                                                        \
  X(ENOMEM, -2, "out of host memory")                                                      \
  X(ECONNECT, -3, "cannot connect to gpupoold")                                            \
  X(EPROTO, -4, "protocol error")                                                          \
  X(EVERSION, -5, "protocol version mismatch between client and daemon")                   \
  X(EIO, -6, "connection to gpupoold failed")                                              \
  X(ENOENT, -7, "no such pool, buffer, hold or name")                                      \
  X(EEXIST, -8, "name already published")                                                  \
  X(ENOSPC, -9, "pool is out of memory")                                                   \
  X(ETIMEDOUT, -10, "timed out")                                                           \
  X(ETOOBIG, -11, "request larger than the pool or the slab limit allows")                 \
  X(EPERM, -12, "permission denied")                                                       \
  X(ENOTSUP, -13, "not supported by this backend or build")                                \
  X(EBACKEND, -14, "backend (CUDA or memfd) call failed")                                  \
  X(ELIMIT, -15, "a configured limit was reached")                                         \
  X(ECLOSED, -16, "the daemon closed the connection")                                      \
  X(EBUSY, -17, "resource busy")                                                           \
  X(ENAME, -18, "invalid name")                                                            \
  X(EMETA, -19, "invalid tensor metadata")                                                 \
  X(ERDONLY, -20, "buffer is held read-only")                                              \
  X(EFD, -21, "file descriptor error")                                                     \
  X(ECONFIG, -22, "invalid configuration")                                                 \
  X(ELOST, -23, "hold lost when the daemon restarted")                                     \
  X(ESTALE, -24, "file changed since it was published")                                    \
  X(EPEER, -25, "a peer gpupoold could not be reached or failed the fetch")

typedef enum {
#define GPUPOOL_ERRNO_GEN(name, val, msg) GPUPOOL_##name = (val),
  GPUPOOL_OK = 0,
  GPUPOOL_ERRNO_MAP(GPUPOOL_ERRNO_GEN)
#undef GPUPOOL_ERRNO_GEN
  GPUPOOL_ERRNO_MIN = -26
} gpupool_errno_t;

/* Longest published name in bytes (excluding the terminating NUL). */
#define GPUPOOL_NAME_MAX 255
/* Most dimensions a tensor description may have. */
#define GPUPOOL_MAX_NDIM 16
/* Size of a share token in bytes. */
#define GPUPOOL_TOKEN_SIZE 24

/* Flags of the calls that take `flags` (opens, gets, file gets): one list, one bit each.
 *
 * GPUPOOL_READ_ONLY (buffer open and get, bundle get): a hold that may not write, and a name
 * published from it (or a token shared from it) hands out only read-only holds. On the host
 * backend the kernel enforces it against a process whose holds on the buffer's slab are all
 * read-only: it gets an O_RDONLY fd of the slab and a PROT_READ mapping. It is not a wall
 * within a tenant: a slab holds buffers of one tenant, and a process of that tenant with a
 * writable hold on any buffer of the slab maps the whole slab writable, and may write the
 * read-only buffer through that mapping (in that process, a read-only hold in such a slab
 * points into the writable mapping). Tenants that must not write each other's memory are
 * separate tenants. On CUDA it is advisory (access flags are the importer's choice).
 *
 * GPUPOOL_FILE_HOST_ONLY (gpupool_file_get): map for the CPU only, even on the CUDA backend
 * (no cudaHostRegister; gpupool_file_device_ptr() then returns NULL).
 *
 * GPUPOOL_KEEP_MAPPED (buffer and bundle gets): keep a dedicated slab (a buffer larger than
 * the pool's slab size, such as a bundle's) mapped after its last buffer here is released, so
 * that getting a later version that lies in it costs no new import (importing a 2.5 GB
 * allocation takes about 2 ms on an H100). The mapping goes when the daemon frees the buffer
 * and this client next talks to the daemon (any request) or disconnects; until then that
 * memory stays out of the pool. For consumers that keep asking for new versions (weight
 * sync); an idle client holds the memory.
 *
 * GPUPOOL_ON_DEVICE(d) (buffer and bundle gets, blocking and pipelined): the caller wants the
 * version on device d (a CUDA ordinal, 0..1023; on the host backend a pool configured with
 * `device = d` stands for it). When the version lies in a pool of another device, the daemon
 * makes a replica in a pool of device d (once per version and device, however many getters
 * ask at once), fills it with its own copy engines, and hands it over only once every byte is
 * in: the get waits for the copy (within timeout_ms when one is set; with 0 it still waits
 * for the copy, which always ends) and fails with the copy's error when it fails (the next get
 * starts a new one). A replica is held read-only, counts against the tenant of the version it
 * copies, and goes when the version's last holder lets go. Without the flag a get hands over
 * the version where it lies (a GPU of another device maps it over peer access, see
 * gpupool_client_set_devices). GPUPOOL_TARGET_DEVICE is the flag's bit; the device sits in
 * bits 16..25. */
typedef enum {
  GPUPOOL_READ_ONLY = 0x1,
  GPUPOOL_FILE_HOST_ONLY = 0x2,
  GPUPOOL_KEEP_MAPPED = 0x4,
  GPUPOOL_TARGET_DEVICE = 0x8
} gpupool_flags;
#define GPUPOOL_ON_DEVICE(d) ((unsigned)GPUPOOL_TARGET_DEVICE | (((unsigned)(d) & 0x3ffu) << 16))

/* Timeouts, in milliseconds, mean the same in every call that takes one: > 0 waits that long,
 * 0 does not wait (fail at once), GPUPOOL_TIMEOUT_FOREVER (any negative value but
 * GPUPOOL_TIMEOUT_DEFAULT) waits forever. GPUPOOL_TIMEOUT_DEFAULT asks for the library's
 * default where one exists (connecting); elsewhere it waits forever like any negative value. */
#define GPUPOOL_TIMEOUT_FOREVER (-1)
#define GPUPOOL_TIMEOUT_DEFAULT (-2)

/* Opaque connection to gpupoold. Created by gpupool_client_connect(), freed by gpupool_client_disconnect(). */
typedef struct gpupool_client gpupool_client;
/* Opaque hold on a buffer. Created by alloc/open/get, freed by gpupool_buffer_release(). */
typedef struct gpupool_buffer gpupool_buffer;

/* An opaque, copyable token that lets another client open a shared buffer. */
typedef struct {
  uint8_t bytes[GPUPOOL_TOKEN_SIZE];
} gpupool_token;

/* DLPack data type codes (dlpack.h's DLDataTypeCode). */
enum {
  GPUPOOL_DTYPE_INT = 0,
  GPUPOOL_DTYPE_UINT = 1,
  GPUPOOL_DTYPE_FLOAT = 2,
  GPUPOOL_DTYPE_OPAQUE_HANDLE = 3,
  GPUPOOL_DTYPE_BFLOAT = 4,
  GPUPOOL_DTYPE_COMPLEX = 5,
  GPUPOOL_DTYPE_BOOL = 6
};

/* Tensor description published with a buffer. Strides are in elements; strides_present = 0
 * means C-contiguous. byte_offset is where element 0 lies from the start of the buffer. */
typedef struct {
  uint8_t dtype_code;
  uint8_t dtype_bits;
  uint16_t dtype_lanes;
  int32_t ndim;
  int64_t shape[GPUPOOL_MAX_NDIM];
  int64_t strides[GPUPOOL_MAX_NDIM];
  int32_t strides_present;
  uint64_t byte_offset;
} gpupool_tensor_meta;

/* Where a buffer's memory lives. */
typedef enum {
  GPUPOOL_MEM_HOST = 1,      /* memfd-backed host memory */
  GPUPOOL_MEM_DEVICE = 2,    /* CUDA device memory of `device` */
  GPUPOOL_MEM_HOST_NUMA = 3  /* pinned host memory reachable from the GPU */
} gpupool_mem_kind;

/* Pool usage as the daemon reports it. New fields are only ever appended (see gpupool_client_stats). */
typedef struct {
  uint32_t id;
  char name[64];
  gpupool_mem_kind kind;
  int32_t device;
  uint64_t capacity;
  uint64_t slab_size;
  uint64_t max_alloc;
  uint64_t used;
  uint64_t reserved;
  uint64_t used_high;
  uint64_t reserved_high;
  uint64_t backend_used;
  uint64_t backend_reserved;
  uint64_t buffers;
  uint64_t slabs;
  /* Host backend: the GPU this memfd pool stands for (`device = N` in its [pool] section,
   * simulated device memory for testing replicas without GPUs), -1 otherwise. */
  int32_t simulated_device;
} gpupool_pool_stats;

/* Daemon-wide counters. New fields are only ever appended (see gpupool_client_stats). */
typedef struct {
  uint64_t clients;
  uint64_t buffers;
  uint64_t holds;
  uint64_t names;
  uint64_t requests;
  uint64_t errors;
  uint64_t open_fds;
  uint64_t pending_frees;
  uint64_t uptime_s;
  /* Opens that waited for the share of a token handed on before gpupoold had read that share
   * (gpupool_buffer_share_kept_many_nowait), since start; those waiting now. */
  uint64_t opens_waited;
  uint64_t opens_waiting;
} gpupool_daemon_stats;

/* Name of an error code ("ENOSPC"), and its one-line description. Never NULL. */
GPUPOOL_EXTERN const char *gpupool_err_name(int err);
GPUPOOL_EXTERN const char *gpupool_strerror(int err);

/* Full message of the calling thread's last failure in this library (cause and fix); an
 * empty string if the last call succeeded. Valid until the thread's next gpupool call. */
GPUPOOL_EXTERN const char *gpupool_last_error(void);

/* Library version string ("MAJOR.MINOR.PATCH"). */
GPUPOOL_EXTERN const char *gpupool_version_string(void);

/* Socket path the library uses when gpupool_client_connect() gets NULL: $GPUPOOL_SOCKET, else
 * /run/gpupool/gpupoold.sock for root, else $XDG_RUNTIME_DIR/gpupool/gpupoold.sock, or
 * /run/gpupool/gpupoold.sock when only that one exists (the system service).
 * Writes into buf (size len); returns 0 or GPUPOOL_EINVAL if it does not fit. */
GPUPOOL_EXTERN int gpupool_client_default_socket_path(char *buf, size_t len);

/* Default time allowed to connect and to get the daemon's answer to Hello. */
#define GPUPOOL_CONNECT_TIMEOUT_DEFAULT_MS 5000

/* Connect and handshake. socket_path NULL = default; client_name may be NULL. On success
 * *out is a new client the caller frees with gpupool_client_disconnect().
 * timeout_ms limits connecting and the handshake: GPUPOOL_TIMEOUT_DEFAULT =
 * $GPUPOOL_CONNECT_TIMEOUT_MS or GPUPOOL_CONNECT_TIMEOUT_DEFAULT_MS; > 0 that many ms; 0 = do
 * not wait (one try; the daemon must answer Hello within a millisecond); negative = forever.
 * A daemon that does not answer in time (stopped, stuck) fails with GPUPOOL_ETIMEDOUT ("the
 * daemon did not answer in N s"); a socket whose peer does not speak gpupool's protocol with
 * GPUPOOL_EPROTO ("this socket is not gpupoold"). A connect that finds the daemon's queue of
 * waiting connections full (a flood) is tried again with a short backoff until the limit, and
 * then fails with GPUPOOL_ETIMEDOUT saying the queue stayed full. Reconnections use the same
 * limit.
 * The connection comes with a lease: one close-on-exec fd the library keeps for as long as
 * this process maps any of the daemon's memory. Children made by fork() share it and may keep
 * reading buffers mapped before the fork, also after the parent has exited: the daemon reuses
 * that memory only once every process holding the lease has exited or closed it. A process
 * that closes every fd but keeps using its mappings defeats this. */
GPUPOOL_EXTERN int gpupool_client_connect(const char *socket_path, const char *client_name,
                                          int timeout_ms, gpupool_client **out);
/* Change the limit later reconnections use (timeout_ms as for gpupool_client_connect). */
GPUPOOL_EXTERN int gpupool_client_set_connect_timeout(gpupool_client *c, int timeout_ms);

/* 1 when this connection orders GPU work with host-side fences instead of the daemon's
 * inter-process events, 0 otherwise. CUDA keeps each inter-process event in a file in /dev/shm
 * that only the daemon's uid may open, so a client of another uid (root excepted) cannot use
 * them: it then synchronizes the stream it passes to gpupool_buffer_publish and gpupool_buffer_release (and
 * their bundle forms) before the request goes out, and the daemon answers its gets and opens
 * only once the producer's ready event has completed (its timeout does not cover that wait,
 * as a stream's wait on the event would not time out either). Correct either way; what it
 * costs is that publish and release wait for the stream's work on the host, holding the
 * client's lock (other threads' requests on the same gpupool_client wait too: give each
 * thread its own client where that matters). $GPUPOOL_HOST_FENCES=1
 * forces it (a container with its own /dev/shm), =0 forbids it; unset, the library decides
 * per connection from the daemon's uid. Always 0 on the host backend, and with a gpupoold
 * too old to hold gets back (then events are used, and fail with the reason). */
GPUPOOL_EXTERN int gpupool_client_host_fences(gpupool_client *c);

/* Tell the library which CUDA devices this process will touch pool memory from. Pools
 * imported later (and those already imported) get read/write access for each of them
 * (cudaMemPoolSetAccess; fails with GPUPOOL_ENOTSUP naming the device pair when peers cannot
 * access each other). Without a call, only each pool's resident device is used. No-op on
 * the host backend. */
GPUPOOL_EXTERN int gpupool_client_set_devices(gpupool_client *c, const int *devices, int n);

/* Release every buffer still held through c, unmap everything (mappings of a daemon that has
 * since restarted included), then close the lease, then the connection, and free c: the
 * process keeps no gpupool fd or mapping. Buffers obtained from c become invalid. NULL is
 * allowed. */
GPUPOOL_EXTERN void gpupool_client_disconnect(gpupool_client *c);

/* Allocate size bytes in pool `pool` (NULL or "" = the first pool). When the pool is full,
 * wait up to timeout_ms for memory to come back (0 = fail at once with GPUPOOL_ENOSPC,
 * whose message says how much was asked and how much is free). On success *out is a hold
 * owned by the caller, freed by gpupool_buffer_release(). The memory is usable in `stream`. */
GPUPOOL_EXTERN int gpupool_buffer_alloc(gpupool_client *c, const char *pool, size_t size,
                                        int timeout_ms, void *stream, gpupool_buffer **out);

/* Copy into n buffers at once: len[i] bytes from src[i] to dst[i] at byte offset off[i] (the
 * ranges written must not overlap), the way a message's storages go into copy buffers. Host
 * buffers, and pinned host-NUMA ones without GPUPOOL_COPY_SRC_ON_STREAM_DEVICE, are written with
 * memcpy before it returns (src must then be host memory). The others are written in stream
 * order on `stream`, in as few operations as the hardware allows: with
 * GPUPOOL_COPY_SRC_ON_STREAM_DEVICE (the caller says every src lies in device memory of the
 * stream's device) those on the stream's device go through gpupool's gather kernel, up to 255
 * copies a launch, the rest one cudaMemcpyAsync each. A range past its buffer's end, a
 * read-only hold or a NULL pointer fails with GPUPOOL_EINVAL before anything is copied.
 * *gathered (may be NULL): how many went through the kernel. */
enum { GPUPOOL_COPY_SRC_ON_STREAM_DEVICE = 0x1 };
GPUPOOL_EXTERN int gpupool_buffer_copy_in_many(gpupool_buffer *const *dst, const uint64_t *off,
                                               const void *const *src, const size_t *len, int n, void *stream,
                                               unsigned flags, int *gathered);

/* Drop the hold b and free the handle b. On CUDA, the client's mapping stays valid for
 * work already queued in `stream`; the range is reused only after that work completes.
 * The memory returns to the pool when its last holder lets go. */
GPUPOOL_EXTERN int gpupool_buffer_release(gpupool_buffer *b, void *stream);

/* Address of the buffer in this process (device pointer on CUDA device pools). */
GPUPOOL_EXTERN void *gpupool_buffer_ptr(const gpupool_buffer *b);
GPUPOOL_EXTERN size_t gpupool_buffer_size(const gpupool_buffer *b);
/* CUDA device ordinal of the memory, or -1 for host memory. */
GPUPOOL_EXTERN int gpupool_buffer_device(const gpupool_buffer *b);
GPUPOOL_EXTERN gpupool_mem_kind gpupool_buffer_kind(const gpupool_buffer *b);
/* Daemon-wide id of the buffer (same in every process that holds it). */
GPUPOOL_EXTERN uint64_t gpupool_buffer_id(const gpupool_buffer *b);
/* The accessors' answers in one call (for bindings that pay per call), in out[0..6): [0] pointer, [1]
 * size, [2] kind (gpupool_mem_kind), [3] device + 1 (0 for host memory), [4] id, [5] read-only. */
GPUPOOL_EXTERN void gpupool_buffer_facts(const gpupool_buffer *b, uint64_t *out);
/* gpupool_buffer_facts of bufs[0..n) in one call, buffer i's in out[6 * i .. 6 * i + 6) (a
 * message's holds, opened together, read by a binding without a call each). */
GPUPOOL_EXTERN void gpupool_buffer_facts_many(gpupool_buffer *const *bufs, int n, uint64_t *out);
GPUPOOL_EXTERN int gpupool_buffer_read_only(const gpupool_buffer *b);
/* Tensor description the buffer was published with: 0 and *out filled, or GPUPOOL_ENOENT. */
GPUPOOL_EXTERN int gpupool_buffer_tensor(const gpupool_buffer *b, gpupool_tensor_meta *out);
/* The client a buffer came from (not owned by the caller). */
GPUPOOL_EXTERN gpupool_client *gpupool_buffer_client(const gpupool_buffer *b);

/* Make a token another client can pass to gpupool_buffer_open(). On CUDA, the ready event is
 * recorded in `stream` first, so openers see everything queued there before the call. */
GPUPOOL_EXTERN int gpupool_buffer_share(gpupool_buffer *b, void *stream, gpupool_token *out);

/* A kept share: as gpupool_buffer_share, but the daemon keeps a hold of its own on the buffer
 * until the token is opened once (the opener's hold takes its place) or until the daemon's
 * share_keep_ms passes, so the caller may release b, disconnect or exit at once: the token of
 * a message still in flight (a tensor pickled into a queue) stays good. A second open of the
 * token, or one after expiry, fails with GPUPOOL_ENOENT. Each kept share counts as a hold of
 * the caller's tenant; GPUPOOL_ELIMIT past max_kept_shares_per_client unopened ones. */
GPUPOOL_EXTERN int gpupool_buffer_share_kept(gpupool_buffer *b, void *stream, gpupool_token *out);

/* Open a shared buffer: a new hold owned by the caller. flags: GPUPOOL_READ_ONLY. */
GPUPOOL_EXTERN int gpupool_buffer_open(gpupool_client *c, const gpupool_token *token, unsigned flags,
                                       void *stream, gpupool_buffer **out);

/* n buffers of pool (NULL: the default) of sizes[0..n) bytes, as gpupool_buffer_alloc with no
 * wait for memory (GPUPOOL_ENOSPC at once), their requests in flight together: one round
 * trip. All or nothing: on error out[] is all NULL and nothing stays allocated. */
GPUPOOL_EXTERN int gpupool_buffer_alloc_many(gpupool_client *c, const char *pool, const size_t *sizes, int n,
                                             void *stream, gpupool_buffer **out);

/* Kept shares (gpupool_buffer_share_kept) of bufs[0..n), all of one client, in one request:
 * out[i] is the token of bufs[i]. All or nothing: when one cannot be shared (GPUPOOL_ELIMIT
 * past max_kept_shares_per_client, a buffer lost with a previous daemon), none is. The ready
 * event of each is recorded in `stream` first (none when the stream has nothing queued: each
 * event then says what it said before), one after another, so that they are ready together:
 * an opener of several of the tokens with gpupool_buffer_open_many makes its stream wait on one
 * of their events, not on each. A buffer's event says only its last record: one shared again
 * (from another stream) before an earlier token of it was opened orders that opener after the
 * later record, for the buffers of its group too. In the same round trip, ask[0..nask) (buffers
 * of the same client; ask may be NULL when nask is 0) are reported on as
 * gpupool_buffer_idle_many does, in idle[0..nask). GPUPOOL_EINVAL past the daemon's
 * max_share_batch (default 1024) for either set: split larger ones. */
GPUPOOL_EXTERN int gpupool_buffer_share_kept_many(gpupool_buffer *const *bufs, int n, void *stream,
                                                  gpupool_token *out, gpupool_buffer *const *ask, int nask,
                                                  int *idle);

/* Kept shares of bufs[0..n) as gpupool_buffer_share_kept_many makes them (no idle asks), whose
 * tokens are made here so that the call need not wait for the daemon's reply: it records the
 * ready events, sends the request and returns. The tokens use ids the daemon reserved for
 * this connection (256 at a time: the first such call of a connection, and every 256 tokens,
 * waits for its reply, which reserves the next ones) and secrets drawn here. The daemon reads
 * the request before anything this process sends it later; an Open of one of the tokens that
 * it reads first (a receiver quicker than the daemon) waits for the share, at most the
 * daemon's open_wait_ms, and fails at once, saying so, if this connection closes first. A
 * failure of the share itself (a hold released meanwhile, max_kept_shares_per_client) is not
 * returned here: the tokens' Opens fail with its reason, and
 * gpupool_client_nowait_failures counts it. A buffer lost with a previous daemon fails here
 * with GPUPOOL_ELOST, as gpupool_buffer_share_kept_many does. */
GPUPOOL_EXTERN int gpupool_buffer_share_kept_many_nowait(gpupool_buffer *const *bufs, int n, void *stream,
                                                         gpupool_token *out);
/* How many shares of c that did not wait for their reply (gpupool_buffer_share_kept_many_nowait)
 * failed, as far as their replies were read (each later request of c reads those that came);
 * the last one's reason into msg[0..len) when msg is not NULL. */
GPUPOOL_EXTERN uint64_t gpupool_client_nowait_failures(gpupool_client *c, char *msg, size_t len);

/* Open tokens[0..n) (as gpupool_buffer_open, same flags) with as few requests as the slabs
 * allow: one, unless the buffers lie in more slabs new to this process than one reply can
 * carry the fds of. All or nothing: on error no buffer is opened (out[] all NULL) and no kept
 * share is used up by the request that failed. GPUPOOL_EINVAL past max_share_batch. `stream`
 * waits on the ready events of the buffers whose producers' work has not completed, once per
 * ready group (the tokens of one gpupool_buffer_share_kept_many call that recorded them) and
 * once per event (a sharer's buffers take their events in turn from a few it has). */
GPUPOOL_EXTERN int gpupool_buffer_open_many(gpupool_client *c, const gpupool_token *tokens, int n, unsigned flags,
                                            void *stream, gpupool_buffer **out);

/* Whether each of bufs[0..n) (all of one client) is referenced by the caller's hold alone:
 * idle[i] = 1 when nobody else holds it (no other hold, kept share not yet opened, name or
 * copy), every earlier holder's done event has completed and no holder that went away may
 * still touch it; then the caller may write it again without anyone seeing the write. One
 * request; GPUPOOL_EINVAL past max_share_batch. */
GPUPOOL_EXTERN int gpupool_buffer_idle_many(gpupool_buffer *const *bufs, int n, int *idle);

/* Release bufs[0..n) (all of one client), as gpupool_buffer_release does each, in `stream`,
 * with their holds named together: one request per max_share_batch of them (one per buffer,
 * in flight together, with a daemon older than this library). Every handle is freed, also on
 * error; GPUPOOL_EINVAL (nothing released) when a buffer is NULL or of another client. */
GPUPOOL_EXTERN int gpupool_buffer_release_many(gpupool_buffer *const *bufs, int n, void *stream);

/* Publish b under `name` (1..GPUPOOL_NAME_MAX bytes). The name holds the buffer until
 * gpupool_name_unpublish() or until the name is published again (its next version, see
 * "versions" below), so the caller may release b right after. meta may be NULL; when given,
 * the daemon checks that the tensor fits in the buffer. The ready event is recorded in
 * `stream` first. *version (may be NULL) receives the version made. Names are per tenant: a
 * plain name is seen only by clients of the publisher's tenant (its uid unless the config
 * groups uids); share across tenants through a pool the daemon's config shares with a group,
 * under the name "group:GROUP/NAME". */
GPUPOOL_EXTERN int gpupool_buffer_publish(gpupool_buffer *b, const char *name,
                                          const gpupool_tensor_meta *meta, void *stream,
                                          uint64_t *version);

/* Publish as gpupool_buffer_publish, and make replicas of the version on each of the n
 * devices (1..16, each once) at once (broadcast): one copy job along them as a chain, so that
 * getters with GPUPOOL_ON_DEVICE(d) find the replica ready or in progress. Refused before
 * publishing (GPUPOOL_EINVAL naming the device) when a device has no pool the buffer's tenant
 * may use. devices may be NULL when n is 0. */
GPUPOOL_EXTERN int gpupool_buffer_publish_to(gpupool_buffer *b, const char *name,
                                             const gpupool_tensor_meta *meta, void *stream,
                                             const int *devices, int n, uint64_t *version);

/* Get the buffer published under `name` at a version newer than `newer_than` (0 = the
 * version published now), waiting up to timeout_ms for a producer to publish it (0 = fail at
 * once with GPUPOOL_ENOENT; negative = wait forever). On success *out is a new hold owned by
 * the caller and *version (may be NULL) the version got. flags: GPUPOOL_READ_ONLY,
 * GPUPOOL_KEEP_MAPPED. The name must hold a single buffer (GPUPOOL_EINVAL for a bundle). */
GPUPOOL_EXTERN int gpupool_buffer_get(gpupool_client *c, const char *name, uint64_t newer_than,
                                      int timeout_ms, unsigned flags, void *stream,
                                      gpupool_buffer **out, uint64_t *version);

/* Remove a name. Holders keep their buffers; the memory goes when the last one lets go. */
GPUPOOL_EXTERN int gpupool_name_unpublish(gpupool_client *c, const char *name);

/* ---- read-only file objects ----------------------------------------------------------------
 *
 * A file (or a range of it) published under a name, which other processes map without reading
 * it into memory of their own: every consumer maps the same page cache, so a 20 GB dataset is
 * in RAM once however many workers read it. On the CUDA backend the mapping is also registered
 * with the GPU (read-only, mapped): kernels read it in place over PCIe, and copies from it run
 * at pinned-memory speed.
 *
 * Permissions: gpupool_file_publish opens the file itself, O_RDONLY with this process's own
 * credentials, and passes the fd to the daemon, so a process can publish only files it could
 * read itself; the daemon's config may restrict further (allow_files, file_paths). Consumers
 * are the clients that see the name (the publisher's tenant, or a group for "group:G/NAME");
 * each receives a read-only fd of the whole file, although the library maps only the range.
 *
 * Changes: a get is refused with GPUPOOL_ESTALE when the file changed since it was published
 * (its size or mtime moved, or it is now shorter than the range), and the library never maps
 * past the end of the file. Limit: a file truncated by someone with write access AFTER a
 * consumer mapped it can still fault (SIGBUS) in that consumer when it touches the pages that
 * went away; publish files that are complete and that nobody writes any more. */

/* Opaque mapping of a published file. Created by gpupool_file_get(), freed by
 * gpupool_file_release(). */
typedef struct gpupool_file gpupool_file;

/* What a published file was when it was published. */
typedef struct {
  uint64_t offset;     /* the range in the file */
  uint64_t length;
  uint64_t size;       /* the file's size when published */
  uint64_t dev, ino;   /* its identity (st_dev, st_ino) */
  int64_t mtime_sec;   /* its mtime when published */
  uint32_t mtime_nsec;
} gpupool_file_info;

/* Publish `length` bytes of the file at `path` from `offset` under `name` (length 0 = to the
 * end of the file). The file is opened here, O_RDONLY, with the caller's own permissions (a
 * symlink is followed as any open would); the name holds the daemon's copy of the fd until
 * gpupool_name_unpublish(name). Errors: GPUPOOL_ENOENT (no such file), GPUPOOL_EPERM (the caller
 * cannot read it, or the daemon's config does not allow it), GPUPOOL_EINVAL (not a regular
 * file, empty range, range past the end of the file: the message names the sizes),
 * GPUPOOL_EEXIST, GPUPOOL_ELIMIT (max_names, max_names_per_uid, max_files). info may be NULL;
 * otherwise it receives the range as published. */
GPUPOOL_EXTERN int gpupool_file_publish(gpupool_client *c, const char *name, const char *path, uint64_t offset,
                                        uint64_t length, gpupool_file_info *info);

/* Map the file published under `name`, waiting up to timeout_ms for it to be published (0 =
 * fail at once with GPUPOOL_ENOENT; negative = wait forever). The range is mapped once,
 * read-only and shared (MAP_SHARED, PROT_READ); on the CUDA backend it is also registered with
 * the current device's context (unless flags has GPUPOOL_FILE_HOST_ONLY). GPUPOOL_ESTALE when
 * the file changed since it was published. On success *out is owned by the caller, freed with
 * gpupool_file_release(); it does not depend on c (it stays valid after gpupool_client_disconnect). */
GPUPOOL_EXTERN int gpupool_file_get(gpupool_client *c, const char *name, int timeout_ms, unsigned flags,
                                    gpupool_file **out);
/* Address of the range's first byte in this process (read-only memory). */
GPUPOOL_EXTERN const void *gpupool_file_ptr(const gpupool_file *f);
/* Device address of the range's first byte (CUDA backend, registered mapping), or NULL. */
GPUPOOL_EXTERN const void *gpupool_file_device_ptr(const gpupool_file *f);
/* Bytes in the range. */
GPUPOOL_EXTERN size_t gpupool_file_size(const gpupool_file *f);
/* What the file was when published. */
GPUPOOL_EXTERN int gpupool_file_info_get(const gpupool_file *f, gpupool_file_info *out);
/* Unregister (CUDA) and unmap the range, and free f. Work still queued on the GPU that reads
 * it must have completed (synchronize first). NULL is allowed. */
GPUPOOL_EXTERN void gpupool_file_release(gpupool_file *f);

/* Daemon counters and up to max_pools pools (*n_pools set to how many were written).
 * daemon and pools may be NULL. The structs grow at their end in later releases without an
 * ABI break: gpupool_client_stats() passes the sizes this header knows, and the library fills
 * that much of each (a newer library leaves its newer fields out; an older one zeroes what it
 * does not know), striding the pools array by the caller's struct size. */
GPUPOOL_EXTERN int gpupool_client_stats_sized(gpupool_client *c, gpupool_daemon_stats *daemon,
                                              size_t daemon_size, gpupool_pool_stats *pools,
                                              size_t pool_size, int max_pools, int *n_pools);
#define gpupool_client_stats(c, daemon, pools, max_pools, n_pools)                              \
  gpupool_client_stats_sized((c), (daemon), sizeof(gpupool_daemon_stats), (pools),              \
                             sizeof(gpupool_pool_stats), (max_pools), (n_pools))
/* The sizes of the first release's structs: the least gpupool_client_stats_sized accepts. */
#define GPUPOOL_STATS_MIN_DAEMON_SIZE (9 * sizeof(uint64_t))
#define GPUPOOL_STATS_MIN_POOL_SIZE (offsetof(gpupool_pool_stats, slabs) + sizeof(uint64_t))

/* Ask the daemon to return every tenant's unused slabs to the backend. An operator's request:
 * GPUPOOL_EPERM unless the caller is root or the daemon's own uid. */
GPUPOOL_EXTERN int gpupool_client_trim(gpupool_client *c);

/* Daemon restarts. When gpupoold goes away (restart, crash), the request in flight fails with
 * GPUPOOL_ECLOSED; the next request reconnects, retrying with backoff for up to budget_ms
 * (default 5000, or $GPUPOOL_RECONNECT_MS; 0 = never reconnect). Holds of the old connection
 * are lost: their buffers stay mapped and readable here until released (release frees only
 * the local side and returns 0), and share/publish on them fail with GPUPOOL_ELOST. A daemon
 * that kept its state across the restart (an fd store) gives them back on the reconnection
 * instead, claimed with a secret it gave the old connection: gpupool_buffer_lost is then 0 and
 * they work as before (one taken just before a crash may still be lost). */
GPUPOOL_EXTERN int gpupool_client_set_reconnect(gpupool_client *c, int budget_ms);
/* How many times c has reconnected. */
GPUPOOL_EXTERN uint64_t gpupool_client_reconnect_count(gpupool_client *c);
/* How many slab mappings c has made (each an import of an fd the daemon sent: on CUDA, an
 * IPC open of the slab's memory), over its life. A get of memory already mapped here (a slab
 * another buffer of this process maps, or one kept by GPUPOOL_KEEP_MAPPED) adds none. */
GPUPOOL_EXTERN uint64_t gpupool_client_slab_maps(gpupool_client *c);
/* How many times c made a stream wait on a producer's ready event, over its life: once per
 * buffer got or opened whose producer's work had not completed yet (none when it had, and
 * none on a backend without events). gpupool_buffer_open_many waits once per ready group: the
 * buffers of one gpupool_buffer_share_kept_many call whose ready events it recorded (their
 * stream was busy) are ready together, so opening them together makes one wait, not one each. */
GPUPOOL_EXTERN uint64_t gpupool_client_ready_waits(gpupool_client *c);
/* 1 when b's hold was lost because the daemon went away. */
GPUPOOL_EXTERN int gpupool_buffer_lost(const gpupool_buffer *b);
/* Names this client had published that were lost when the daemon went away (not yet
 * reported): copies up to max of them into names, sets *n, and forgets those reported. A
 * daemon that kept its state across the restart (an fd store: systemd's or gpupoold
 * --supervise) still has them: each name the client had published is looked up in the new
 * daemon first (a read-only get, released at once) and reported only when it is not there. */
GPUPOOL_EXTERN int gpupool_client_lost_names(gpupool_client *c, char (*names)[GPUPOOL_NAME_MAX + 1], int max, int *n);

/* ---- versions ------------------------------------------------------------------------------ */

/* Publishing a name that exists replaces it: the name's version goes from N to N+1 in one
 * step (a getter sees version N or N+1, never a mix), and version N's buffers go back to the
 * pool when their last holder lets go; holders of version N keep reading it meanwhile. A new
 * name starts at version 1; unpublishing forgets the name and its count. */

/* ---- bundles -------------------------------------------------------------------------------- */

/* A bundle is a named set of members (a state dict, a batch): each member a named range of a
 * buffer with its own tensor description. It is allocated in one request, published in one
 * request (all members become visible at once, as one version of its name), and got in one
 * request. gpupool_bundle_alloc places members one after the other, each aligned, in as few
 * buffers as possible (one, up to the pool's largest allocation), so a consumer maps one
 * region and waits on one ready event for all of them. */

/* Opaque bundle: its buffers (holds) and member table. Freed by gpupool_bundle_release(). */
typedef struct gpupool_bundle gpupool_bundle;

/* Most members a bundle may have (the daemon's max_bundle_members may be lower). */
#define GPUPOOL_BUNDLE_MAX_MEMBERS 65536

/* A member asked for by gpupool_bundle_alloc. */
typedef struct {
  const char *name;                /* 1..GPUPOOL_NAME_MAX bytes, unique in the bundle */
  uint64_t size;                   /* bytes, > 0 */
  const gpupool_tensor_meta *meta; /* optional: must fit in size (byte_offset from the member) */
} gpupool_member_spec;

/* A member of a bundle as this process sees it. Pointers stay valid while the bundle lives. */
typedef struct {
  const char *name;
  void *ptr;                       /* address in this process (device pointer on device pools) */
  uint64_t size;
  int has_meta;
  gpupool_tensor_meta meta;
  int buffer;                      /* index of its buffer (gpupool_bundle_buffer) */
  uint64_t offset;                 /* offset inside that buffer */
} gpupool_member;

/* A member to publish with gpupool_bundle_publish_members: a range of a buffer the caller holds. */
typedef struct {
  const char *name;                /* 1..GPUPOOL_NAME_MAX bytes, unique in the bundle */
  gpupool_buffer *buffer;          /* held by the caller; not taken over */
  uint64_t offset, size;           /* the range inside the buffer (size > 0) */
  const gpupool_tensor_meta *meta; /* optional: must fit in size */
} gpupool_member_ref;

/* Allocate n members (1..GPUPOOL_BUNDLE_MAX_MEMBERS) in pool `pool` (NULL = the first) in one
 * request. alignment: of each member, a power of two up to 2 MiB, 0 = the pool's. timeout_ms
 * as for gpupool_buffer_alloc. On success *out is a bundle owned by the caller (version 0 until
 * published), freed by gpupool_bundle_release(). Duplicate or empty member names, sizes that
 * overflow and tensor descriptions that do not fit are refused (GPUPOOL_EINVAL, GPUPOOL_ENAME,
 * GPUPOOL_EMETA) with nothing allocated. */
GPUPOOL_EXTERN int gpupool_bundle_alloc(gpupool_client *c, const char *pool,
                                        const gpupool_member_spec *members, int n,
                                        uint64_t alignment, int timeout_ms, void *stream,
                                        gpupool_bundle **out);

/* Publish bundle b under `name` in one request: a new name (version 1) or the next version
 * of an existing one. Each buffer's ready event is recorded in `stream` first, so getters see
 * everything queued there before the call. b stays the caller's (release it when done: the
 * name keeps its own hold). *version (may be NULL) is the version made. */
GPUPOOL_EXTERN int gpupool_bundle_publish(gpupool_bundle *b, const char *name, void *stream,
                                          uint64_t *version);

/* Publish as gpupool_bundle_publish, with replicas on each of the n devices at once (as
 * gpupool_buffer_publish_to): a new weight version is local on every device when its getters
 * ask. */
GPUPOOL_EXTERN int gpupool_bundle_publish_to(gpupool_bundle *b, const char *name, void *stream,
                                             const int *devices, int n, uint64_t *version);

/* Publish n members that lie in buffers the caller holds (any mix of buffers of this client)
 * as one bundle, in one request. The buffers stay the caller's. */
GPUPOOL_EXTERN int gpupool_bundle_publish_members(gpupool_client *c, const char *name,
                                                  const gpupool_member_ref *members, int n,
                                                  void *stream, uint64_t *version);

/* Get the bundle published under `name` at a version newer than `newer_than` (0 = the one
 * published now), waiting up to timeout_ms (0 = fail at once with GPUPOOL_ENOENT, negative =
 * forever). A name published with gpupool_buffer_publish comes as a bundle of one member whose name
 * is "". flags: GPUPOOL_READ_ONLY. On success *out is a
 * bundle owned by the caller whose members are usable in `stream`. */
GPUPOOL_EXTERN int gpupool_bundle_get(gpupool_client *c, const char *name, uint64_t newer_than,
                                      int timeout_ms, unsigned flags, void *stream,
                                      gpupool_bundle **out);

/* Drop the bundle's holds (as gpupool_buffer_release does for each buffer) and free it. */
GPUPOOL_EXTERN int gpupool_bundle_release(gpupool_bundle *b, void *stream);

/* Number of members. */
GPUPOOL_EXTERN int gpupool_bundle_count(const gpupool_bundle *b);
/* Version the bundle was got or last published at (0 for a fresh allocation). */
GPUPOOL_EXTERN uint64_t gpupool_bundle_version(const gpupool_bundle *b);
/* Member i (0 <= i < count) into *out: 0, or GPUPOOL_EINVAL for an index out of range. */
GPUPOOL_EXTERN int gpupool_bundle_member(const gpupool_bundle *b, int i, gpupool_member *out);
/* Members first..first+n-1 into out[0..n-1] in one call (for bindings): 0 or GPUPOOL_EINVAL. */
GPUPOOL_EXTERN int gpupool_bundle_members(const gpupool_bundle *b, int first, int n,
                                          gpupool_member *out);
/* An id of b's member table (names, sizes, offsets, descriptions): two bundles got through
 * one connection with the same nonzero id have identical tables, so bindings can keep what
 * they derived from it (the id is the daemon's; it does not carry over a reconnection, see
 * gpupool_client_reconnect_count). 0 when there is none (a single buffer published on its own). */
GPUPOOL_EXTERN uint64_t gpupool_bundle_layout_id(const gpupool_bundle *b);
/* Index of the member called name, or GPUPOOL_ENOENT. */
GPUPOOL_EXTERN int gpupool_bundle_find(const gpupool_bundle *b, const char *name);
/* Number of buffers, and buffer i (owned by the bundle: do not release it). */
GPUPOOL_EXTERN int gpupool_bundle_buffers(const gpupool_bundle *b);
GPUPOOL_EXTERN gpupool_buffer *gpupool_bundle_buffer(const gpupool_bundle *b, int i);

/* ---- pipelining ----------------------------------------------------------------------------- */

/* Several requests in flight from one thread: *_begin sends a request and returns at once
 * with a pending handle; the matching *_end waits for its reply (in any order) and frees the
 * handle, so N independent requests cost about one round trip. A pending request must be
 * ended exactly once (or gpupool_pending_cancel-ed) before its client is disconnected. */
typedef struct gpupool_pending gpupool_pending;

GPUPOOL_EXTERN int gpupool_buffer_get_begin(gpupool_client *c, const char *name, uint64_t newer_than,
                                            int timeout_ms, unsigned flags, gpupool_pending **out);
GPUPOOL_EXTERN int gpupool_buffer_get_end(gpupool_pending *p, void *stream, gpupool_buffer **out,
                                          uint64_t *version);
GPUPOOL_EXTERN int gpupool_bundle_get_begin(gpupool_client *c, const char *name,
                                            uint64_t newer_than, int timeout_ms, unsigned flags,
                                            gpupool_pending **out);
GPUPOOL_EXTERN int gpupool_bundle_get_end(gpupool_pending *p, void *stream,
                                          gpupool_bundle **out);
/* Publish and release, pipelined: the ready (or done) event is recorded at begin. The buffer
 * of a release_begin must not be used after it; its end only reports the daemon's answer. */
GPUPOOL_EXTERN int gpupool_buffer_publish_begin(gpupool_buffer *b, const char *name,
                                                const gpupool_tensor_meta *meta, void *stream,
                                                gpupool_pending **out);
GPUPOOL_EXTERN int gpupool_buffer_release_begin(gpupool_buffer *b, void *stream, gpupool_pending **out);
/* gpupool_buffer_idle_many, pipelined: the Idle request about bufs[0..n) (of one client) goes
 * now, and gpupool_buffer_idle_many_end waits for its answer into idle[0..n) (the n given
 * here), which says what was true when the daemon read the request. */
GPUPOOL_EXTERN int gpupool_buffer_idle_many_begin(gpupool_buffer *const *bufs, int n, gpupool_pending **out);
GPUPOOL_EXTERN int gpupool_buffer_idle_many_end(gpupool_pending *p, int *idle);
/* End a publish or release begun above: 0 or the request's error; *version (may be NULL) is
 * the version a publish made. */
GPUPOOL_EXTERN int gpupool_pending_end(gpupool_pending *p, uint64_t *version);
/* Forget a pending request: its reply is waited for and undone (a hold it brings is
 * released), then the handle is freed. */
GPUPOOL_EXTERN void gpupool_pending_cancel(gpupool_pending *p);

/* Number of bytes a tensor with this description spans from the buffer start (offset +
 * extent), or 0 with GPUPOOL_EMETA in *err when it is invalid. Shared by both sides. */
GPUPOOL_EXTERN uint64_t gpupool_tensor_span(const gpupool_tensor_meta *m, int *err);

#ifdef __cplusplus
}
#endif

#endif /* GPUPOOL_GPUPOOL_H */
