/*
 * libgpupool-torch-alloc: a torch.cuda.memory.CUDAPluggableAllocator over gpupool, so that
 * every CUDA tensor of a process is a gpupool buffer of its own, shared by gpupool.torch
 * without a copy. torch calls gpupool_torch_alloc(size, device, stream) and
 * gpupool_torch_free(ptr, size, device, stream); each is one request to gpupoold through a
 * client of this library's own (connected on first use to $GPUPOOL_SOCKET or the socket set
 * with gpupool_torch_alloc_configure), in the pool configured for the device. A table maps
 * each pointer to its buffer, for the frees and for gpupool_torch_alloc_find, which tells
 * gpupool.torch which buffer (and offset) a storage is.
 *
 * Only the public API of libgpupool-client is used. Errors: alloc returns NULL (torch raises
 * its out-of-memory error) and the reason is kept for gpupool_torch_alloc_last_error.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <gpupool/gpupool.h>

#define EXPORT __attribute__((visibility("default")))
#define MAX_DEVICES 64

/* The library's interface (Python declares the same with ctypes; torch looks up the first two
 * by name). */
EXPORT int gpupool_torch_alloc_configure(const char *socket, const char *const *pool_names, int n);
EXPORT void *gpupool_torch_alloc(size_t size, int device, void *stream);
EXPORT void gpupool_torch_free(void *ptr, size_t size, int device, void *stream);
EXPORT int gpupool_torch_alloc_find(const void *ptr, gpupool_buffer **buf);
EXPORT const char *gpupool_torch_alloc_last_error(void);
EXPORT void gpupool_torch_alloc_counts(uint64_t *allocs, uint64_t *frees, uint64_t *live);

typedef struct entry {
  uintptr_t ptr;
  size_t size;
  gpupool_buffer *buf;
  struct entry *next;
} entry;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static gpupool_client *cli;
static char *socket_path;
static char *pools[MAX_DEVICES];
static entry **table;
static size_t nbuckets, nentries;
static char last_error[512];
static uint64_t nallocs, nfrees;

static size_t bucket(uintptr_t p) { return (size_t)((p >> 9) * 0x9E3779B97F4A7C15ull) & (nbuckets - 1); }

/* With mu held. */
static int grow(void) {
  size_t n = nbuckets ? nbuckets * 2 : 1024;
  entry **t = calloc(n, sizeof *t);
  if (!t)
    return -1;
  for (size_t i = 0; i < nbuckets; i++)
    for (entry *e = table[i], *nx; e; e = nx) {
      nx = e->next;
      size_t b = (size_t)((e->ptr >> 9) * 0x9E3779B97F4A7C15ull) & (n - 1);
      e->next = t[b];
      t[b] = e;
    }
  free(table);
  table = t;
  nbuckets = n;
  return 0;
}

static void set_error(const char *what, int rc) {
  snprintf(last_error, sizeof last_error, "%s: %s: %s", what, gpupool_err_name(rc), gpupool_last_error());
}

/* Where the allocator connects (NULL: $GPUPOOL_SOCKET or the default) and the pool of each
 * device (pool_names[i] for device i; NULL or "": allocations there fail). Call before the
 * first allocation; 0, or -1 when out of memory. */
EXPORT int gpupool_torch_alloc_configure(const char *socket, const char *const *pool_names, int n) {
  int rc = 0;
  pthread_mutex_lock(&mu);
  free(socket_path);
  socket_path = socket && *socket ? strdup(socket) : NULL;
  if (socket && *socket && !socket_path)
    rc = -1;
  for (int i = 0; i < MAX_DEVICES; i++) {
    free(pools[i]);
    pools[i] = NULL;
    if (i < n && pool_names[i] && *pool_names[i] && !(pools[i] = strdup(pool_names[i])))
      rc = -1;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

EXPORT void *gpupool_torch_alloc(size_t size, int device, void *stream) {
  gpupool_buffer *b = NULL;
  gpupool_client *c;
  const char *pool;
  entry *e;
  int rc;
  /* The lock covers the connection's making and the table, not the round trip to the daemon:
   * other threads' frees and lookups (a gpupool.torch send) do not wait behind an allocation. */
  pthread_mutex_lock(&mu);
  if (!cli && (rc = gpupool_client_connect(socket_path, "torch-allocator", GPUPOOL_TIMEOUT_DEFAULT, &cli)) != 0) {
    cli = NULL;
    set_error("gpupool torch allocator: cannot connect to gpupoold", rc);
    pthread_mutex_unlock(&mu);
    return NULL;
  }
  if (device < 0 || device >= MAX_DEVICES || !pools[device]) {
    snprintf(last_error, sizeof last_error,
             "gpupool torch allocator: no gpupool pool for CUDA device %d (the daemon has no device pool "
             "there, or use_allocator(pools=...) named none)", device);
    pthread_mutex_unlock(&mu);
    return NULL;
  }
  c = cli;
  pool = pools[device];
  pthread_mutex_unlock(&mu);
  if (!(e = malloc(sizeof *e))) {
    pthread_mutex_lock(&mu);
    snprintf(last_error, sizeof last_error, "gpupool torch allocator: out of host memory for its table");
    pthread_mutex_unlock(&mu);
    return NULL;
  }
  rc = gpupool_buffer_alloc(c, pool, size ? size : 1, 0, stream, &b);
  pthread_mutex_lock(&mu);
  if (rc != 0) {
    char what[96];
    snprintf(what, sizeof what, "gpupool torch allocator: allocation of %zu bytes on device %d", size, device);
    set_error(what, rc);
    goto fail;
  }
  if ((nentries + 1) * 2 > nbuckets && grow() != 0) {
    snprintf(last_error, sizeof last_error, "gpupool torch allocator: out of host memory for its table");
    goto fail;
  }
  e->ptr = (uintptr_t)gpupool_buffer_ptr(b);
  e->size = size;
  e->buf = b;
  e->next = table[bucket(e->ptr)];
  table[bucket(e->ptr)] = e;
  nentries++;
  nallocs++;
  pthread_mutex_unlock(&mu);
  return (void *)e->ptr;
fail:
  pthread_mutex_unlock(&mu);
  free(e);
  if (b)
    (void)gpupool_buffer_release(b, stream);
  return NULL;
}

EXPORT void gpupool_torch_free(void *ptr, size_t size, int device, void *stream) {
  entry *e = NULL, **pp;
  (void)size;
  (void)device;
  if (!ptr)
    return;
  pthread_mutex_lock(&mu);
  if (nbuckets)
    for (pp = &table[bucket((uintptr_t)ptr)]; *pp; pp = &(*pp)->next)
      if ((*pp)->ptr == (uintptr_t)ptr) {
        e = *pp;
        *pp = e->next;
        nentries--;
        nfrees++;
        break;
      }
  pthread_mutex_unlock(&mu);
  if (!e) {
    fprintf(stderr, "gpupool torch allocator: free of %p, which it did not allocate; ignored\n", ptr);
    return;
  }
  /* The range is reused only after the work queued in `stream` (and every other holder's)
   * is done: the daemon orders it, as torch's own allocator would. */
  (void)gpupool_buffer_release(e->buf, stream);
  free(e);
}

/* The buffer that starts at ptr (a storage's data pointer): 1 and *buf (owned by this
 * library, valid until torch frees the storage), 0 when ptr is not one of its allocations. */
EXPORT int gpupool_torch_alloc_find(const void *ptr, gpupool_buffer **buf) {
  int found = 0;
  pthread_mutex_lock(&mu);
  if (nbuckets)
    for (entry *e = table[bucket((uintptr_t)ptr)]; e; e = e->next)
      if (e->ptr == (uintptr_t)ptr) {
        *buf = e->buf;
        found = 1;
        break;
      }
  pthread_mutex_unlock(&mu);
  return found;
}

/* Why the last allocation failed ("" when none did). */
EXPORT const char *gpupool_torch_alloc_last_error(void) { return last_error; }

/* Allocations and frees so far, and allocations live now. */
EXPORT void gpupool_torch_alloc_counts(uint64_t *allocs, uint64_t *frees, uint64_t *live) {
  pthread_mutex_lock(&mu);
  *allocs = nallocs;
  *frees = nfrees;
  *live = nentries;
  pthread_mutex_unlock(&mu);
}
