/*
 * The CUDA copy engine's insides, shared by copy.c (planning and queueing a job's copies) and
 * copy_watch.c (the thread that learns of a job's end). Not seen outside backend/cuda/.
 */
#ifndef GPUPOOL_BACKEND_CUDA_COPY_INTERNAL_H
#define GPUPOOL_BACKEND_CUDA_COPY_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "cuda_daemon.h"

/* Bytes per piece of a job that stages (the size of a staging slot), of a chain of peer
 * copies (small enough that filling the chain costs little, large enough that the gaps
 * between copies do not show), and of a job with one destination and no staging, which has
 * nothing to pipeline (the largest slab: a segment is never cut). */
#define PIECE ((uint64_t)GPUPOOL__COPY_SLOT_MIB << 20)
#define PIECE_CHAIN ((uint64_t)GPUPOOL__COPY_CHAIN_MIB << 20)
#define PIECE_ONE GPUPOOL_SLAB_HARD_MAX
/* Staging slots in a ring, and events per hop. */
#define SLOTS GPUPOOL__COPY_SLOTS
/* Defaults of the three, which a build may set (-D) to measure others. Measured on 4 H200
 * (bench/RESULTS.md) against 32 MiB x 4 slots / 64 MiB chain pieces and 8 MiB x 16 / 256 MiB:
 * the staged copy gains most from smaller slots (a shorter fill before both directions run),
 * the chained broadcast is the same within 1%, and fewer chain pieces halve copy_start. */
#ifndef GPUPOOL__COPY_SLOT_MIB
#define GPUPOOL__COPY_SLOT_MIB 16
#endif
#ifndef GPUPOOL__COPY_CHAIN_MIB
#define GPUPOOL__COPY_CHAIN_MIB 128
#endif
#ifndef GPUPOOL__COPY_SLOTS
#define GPUPOOL__COPY_SLOTS 8
#endif

typedef enum { HOP_LOCAL, HOP_PEER, HOP_DIRECT, HOP_STAGED } hop_kind;

typedef struct {
  hop_kind kind;
  int from_dev, from_host; /* where the hop reads: the pools of src (hop 0) or dst[h-1] */
  int to_dev, to_host;     /* where it writes: the pools of dst[h] */
  int dev;                 /* GPU whose copy stream runs the hop (staged: the H2D side) */
  cudaStream_t stream;
  int fills_stage;         /* staged: the first staged hop, which copies pieces into the ring */
  cudaStream_t d2h_stream; /* fills_stage: the source GPU's copy stream */
  cudaEvent_t ev[SLOTS];   /* piece k of this hop is done: ev[k % SLOTS] */
  int nev;
} hop;

struct gpupool__bcopy {
  gpupool__cuda_state *st;
  int ndst;
  hop hops[GPUPOOL_COPY_MAX_DSTS];
  void *stage;         /* pinned ring of SLOTS * PIECE bytes; NULL when no hop stages */
  cudaEvent_t d2h_ev;  /* the piece now in the ring has landed there */
  int has_d2h_ev;
  uint64_t piece;      /* bytes per piece */
  uint64_t npieces;    /* pieces queued */
  int done;            /* every final event completed */
  /* In the watcher's list (under its mutex): when the job was queued, its neighbours. */
  int watched;
  uint64_t started_ns;
  gpupool__bcopy *wprev, *wnext;
};

/* The copy watcher (see the top of this file). */
#define WATCH_MIN_NS 4000ull
#define WATCH_MAX_NS 1000000ull

struct gpupool__cuda_watch {
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  gpupool__bcopy *head; /* running jobs not yet seen ended */
  int stop;
  int efd;
};

/* copy_watch.c: the watcher thread (see the top of copy.c). */
void gpupool__cuda_watch_start(gpupool__cuda_state *st); /* st->watch stays NULL when it cannot */
void gpupool__cuda_watch_stop(gpupool__cuda_state *st);
void gpupool__cuda_watch_add(gpupool__bcopy *c);
void gpupool__cuda_watch_remove(gpupool__bcopy *c); /* before its events go back to the pool */
/* 0 while the last event of a hop of c is pending, 1 once every one has completed, -1 when
 * one failed (*which and *err say which hop and how). Queries only: from either thread. */
int gpupool__cuda_job_state(const gpupool__bcopy *c, int *which, cudaError_t *err);

#endif
