/*
 * Shared glue of the fuzz targets (tests/fuzz/README.md says how to run them).
 *
 * Each target defines LLVMFuzzerTestOneInput (and may define LLVMFuzzerInitialize). Built
 * with clang and -DGPUPOOL_FUZZ=ON they link libFuzzer; otherwise they link replay.c, which
 * runs every file of the corpora and regression directories once (ctest does that on every
 * build, gcc included).
 *
 * The two socket targets read their input as a list of chunks, each written with one
 * sendmsg, so that inputs can split frames anywhere and carry fds:
 *   [ctl: 1 byte][len: 2 bytes little-endian][len bytes]...
 * ctl bits 0-2: fds attached to the chunk (0-7; more than 4 is a protocol error for the
 * receiver); bit 3: those fds are sealed memfds (else unsealed); bits 4-5: memfd size
 * (4 KiB, 2 MiB, 8 MiB, 64 MiB); bit 6, in fuzz_daemon only: the replies are not read
 * right after this chunk. A chunk whose length runs past the input takes what is left.
 */
#ifndef GPUPOOL_TESTS_FUZZ_H
#define GPUPOOL_TESTS_FUZZ_H

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

#define FUZZ_MAX_CHUNKS 256
#define FUZZ_CHUNK_HDR 3
#define FUZZ_CTL_NFDS(ctl) ((ctl) & 7)
#define FUZZ_CTL_SEALED 0x08
#define FUZZ_CTL_SIZE(ctl) (((ctl) >> 4) & 3)

typedef struct {
  uint8_t ctl;
  const uint8_t *data;
  size_t len;
} fuzz_chunk;

/* Split an input into at most max chunks; returns how many. */
size_t fuzz_chunks(const uint8_t *in, size_t n, fuzz_chunk *out, size_t max);
/* Bytes of a memfd for a ctl's size bits. */
uint64_t fuzz_memfd_size(uint8_t ctl);
/* One sendmsg (MSG_DONTWAIT unless blocking) of c's bytes from *off, with c's fds attached
 * when *off is 0. Returns 1 when the chunk is out, 0 when the socket is full, -1 on an error
 * (the peer went away). */
int fuzz_send_chunk(int sock, const fuzz_chunk *c, size_t *off);
/* Read and throw away what is waiting on sock (closing any fds that came with it). Returns
 * 1 at end of stream or on an error, else 0. */
int fuzz_drain(int sock);
/* Open fds of this process (to prove an input leaves none behind). */
int fuzz_count_fds(void);
/* abort() with a message: a finding the sanitizers would not see (fd leak, handle left). */
void fuzz_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

#endif
