/*
 * A client process for the gpupoolctl tests: connects under a given client name, allocates
 * a buffer, publishes it under a name, prints "ready" and waits for a line on stdin. Then it
 * makes one more request and reports how it went, which after `gpupoolctl drop-client PID`
 * depends on the mode:
 *   closed     reconnection off: the request must fail because the daemon closed the
 *              connection (GPUPOOL_ECLOSED or GPUPOOL_EIO);
 *   reconnect  the library's default: the request reconnects and succeeds, and the hold of
 *              the dropped connection is reported lost;
 *   resumed    as reconnect, after a restart of a daemon that kept its state: the hold is
 *              given back (not lost).
 *
 * PUBLISH_NAME may be several names separated by commas: the one buffer is published under each.
 * Each EXTRA adds a name of another kind before "ready": bundle=NAME publishes a bundle of two
 * members, file=NAME:PATH the whole file at PATH.
 *
 * Usage: svc_holder SOCKET CLIENT_NAME PUBLISH_NAME SIZE closed|reconnect|resumed [EXTRA...]
 * Exit: 0 when the request after the wait behaved as the mode says, 1 when it did not (the
 *       client was not dropped), 2 on setup failure.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpupool/gpupool.h"

int main(int argc, char **argv) {
  gpupool_client *c = NULL;
  gpupool_buffer *b = NULL, *b2 = NULL;
  char line[64];
  size_t size;
  int rc, reconnect;

  if (argc < 6 || (strcmp(argv[5], "closed") != 0 && strcmp(argv[5], "reconnect") != 0 &&
                    strcmp(argv[5], "resumed") != 0)) {
    fprintf(stderr, "usage: svc_holder SOCKET CLIENT_NAME PUBLISH_NAME SIZE closed|reconnect|resumed [EXTRA...]\n");
    return 2;
  }
  reconnect = strcmp(argv[5], "reconnect") == 0 ? 1 : strcmp(argv[5], "resumed") == 0 ? 2 : 0;
  size = (size_t)strtoull(argv[4], NULL, 10);
  rc = gpupool_client_connect(argv[1], argv[2], GPUPOOL_TIMEOUT_DEFAULT, &c);
  if (rc != 0) {
    fprintf(stderr, "svc_holder: connect: %s\n", gpupool_last_error());
    return 2;
  }
  if (!reconnect && gpupool_client_set_reconnect(c, 0) != 0) {
    fprintf(stderr, "svc_holder: set_reconnect: %s\n", gpupool_last_error());
    return 2;
  }
  rc = gpupool_buffer_alloc(c, NULL, size, 0, NULL, &b);
  if (rc != 0) {
    fprintf(stderr, "svc_holder: alloc: %s\n", gpupool_last_error());
    return 2;
  }
  if (gpupool_buffer_kind(b) == GPUPOOL_MEM_HOST)
    memset(gpupool_buffer_ptr(b), 0x5a, size); /* device memory is not the CPU's to touch */
  for (char *save = NULL, *nm = strtok_r(argv[3], ",", &save); nm; nm = strtok_r(NULL, ",", &save))
    if (gpupool_buffer_publish(b, nm, NULL, NULL, NULL) != 0) {
      fprintf(stderr, "svc_holder: publish %s: %s\n", nm, gpupool_last_error());
      return 2;
    }
  for (int i = 6; i < argc; i++) {
    if (strncmp(argv[i], "bundle=", 7) == 0) {
      gpupool_member_spec m[2] = {{"weight", 8192, NULL}, {"bias", 4096, NULL}};
      gpupool_bundle *bd;
      if (gpupool_bundle_alloc(c, NULL, m, 2, 0, 0, NULL, &bd) != 0 ||
          gpupool_bundle_publish(bd, argv[i] + 7, NULL, NULL) != 0 ||
          gpupool_bundle_publish(bd, argv[i] + 7, NULL, NULL) != 0) { /* version 2 */
        fprintf(stderr, "svc_holder: %s: %s\n", argv[i], gpupool_last_error());
        return 2;
      }
      gpupool_bundle_release(bd, NULL);
    } else if (strncmp(argv[i], "file=", 5) == 0 && strchr(argv[i], ':')) {
      char *path = strchr(argv[i], ':');
      *path++ = '\0';
      if (gpupool_file_publish(c, argv[i] + 5, path, 0, 0, NULL) != 0) {
        fprintf(stderr, "svc_holder: %s: %s\n", argv[i], gpupool_last_error());
        return 2;
      }
    } else {
      fprintf(stderr, "svc_holder: unknown extra '%s'\n", argv[i]);
      return 2;
    }
  }
  printf("ready\n");
  fflush(stdout);
  if (fgets(line, sizeof(line), stdin) == NULL)
    return 2;

  rc = gpupool_buffer_alloc(c, NULL, 4096, 0, NULL, &b2);
  printf("after-wait %d %s reconnects=%llu lost=%d\n", rc, gpupool_err_name(rc),
         (unsigned long long)gpupool_client_reconnect_count(c), gpupool_buffer_lost(b));
  fflush(stdout);
  if (reconnect) {
    int ok = rc == 0 && gpupool_client_reconnect_count(c) == 1 && gpupool_buffer_lost(b) == (reconnect == 1);
    gpupool_client_disconnect(c);
    return ok ? 0 : 1;
  }
  if (rc == 0)
    return 1;
  /* The connection is gone; disconnecting must still be safe. */
  gpupool_client_disconnect(c);
  return rc == GPUPOOL_ECLOSED || rc == GPUPOOL_EIO ? 0 : 1;
}
