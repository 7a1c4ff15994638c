/*
 * Peers' fetching side: the pages of a local copy made ready off the critical path (a thread
 * of its own, below).
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "peers_internal.h"

/* A local copy in memory new to the pool (a slab the daemon maps for the first time) has the
 * kernel allocate, zero and map every page as the data is copied in: on a 2-core VM that took
 * most of a first fetch's time (a 2.47 GB state dict: 7.7 s, against 1 s into a kept slab).
 * A thread of its own faults those pages into the daemon's mapping (MADV_POPULATE_WRITE: no
 * byte is written) while the data arrives, from the copy's end towards its start, until it
 * meets the data; the loop's copies then find the pages there, and the faulting is shared by
 * two cores. The thread only touches the fetch's own buffers, which stay mapped until it has
 * ended: the fetch's end stops it and waits for it (at most one chunk's faults). */
#define PREFAULT_CHUNK (2u << 20)

struct prefault {
  pthread_t thread;
  atomic_int stop;
  _Atomic uint64_t received; /* bytes of the stream in (the copy's data comes about in order) */
  uint32_t n;
  uint8_t *maps[GPUPOOL_WIRE_MAX_FDS]; /* per range: the daemon's mapping of it, its length and */
  uint64_t lens[GPUPOOL_WIRE_MAX_FDS]; /* where it starts in the stream */
  uint64_t starts[GPUPOOL_WIRE_MAX_FDS];
};

static void *prefault_run(void *arg) {
  prefault *pf = arg;
  for (uint32_t i = pf->n; i-- > 0;) {
    for (uint64_t end = pf->lens[i]; end > 0 && !atomic_load(&pf->stop);) {
      uint64_t c = end < PREFAULT_CHUNK ? end : PREFAULT_CHUNK;
      uintptr_t from = ((uintptr_t)pf->maps[i] + end - c) & ~(uintptr_t)4095; /* madvise wants pages */
      if (pf->starts[i] + end <= atomic_load(&pf->received))
        return NULL; /* met the data: the rest is in */
      if (madvise((void *)from, (uintptr_t)pf->maps[i] + end - from, MADV_POPULATE_WRITE) != 0)
        return NULL; /* an older kernel: the copies fault the pages in themselves */
      end -= c;
    }
  }
  return NULL;
}

/* Start faulting in the n ranges (maps, lens, starts as in struct prefault). NULL when no
 * thread could be started: the copies then fault their pages in as before. */
prefault *gpd_pr_prefault_start(uint8_t *const *maps, const uint64_t *lens, const uint64_t *starts, uint32_t n) {
  prefault *pf = calloc(1, sizeof *pf);
  sigset_t all, old;
  int rc;
  if (!pf)
    return NULL;
  pf->n = n;
  memcpy(pf->maps, maps, n * sizeof *maps);
  memcpy(pf->lens, lens, n * sizeof *lens);
  memcpy(pf->starts, starts, n * sizeof *starts);
  atomic_init(&pf->stop, 0);
  atomic_init(&pf->received, 0);
  /* Signals stay the loop's. */
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  rc = pthread_create(&pf->thread, NULL, prefault_run, pf);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc != 0) {
    free(pf);
    return NULL;
  }
  return pf;
}

/* Stop the fetch's thread and wait for it: its buffers may go after this. */
void gpd_pr_prefault_stop(sub *sb) {
  if (!sb->pf)
    return;
  atomic_store(&sb->pf->stop, 1);
  pthread_join(sb->pf->thread, NULL);
  free(sb->pf);
  sb->pf = NULL;
}

void gpd_pr_prefault_received(prefault *pf, uint64_t received) {
  atomic_store_explicit(&pf->received, received, memory_order_relaxed);
}
