/*
 * An application outside the gpupool tree: built only against the installed headers and
 * library (find_package(gpupool) or pkg-config gpupool). It allocates a buffer, fills it,
 * publishes it, gets it back through a second connection and checks every byte.
 *
 * Usage: consumer SOCKET
 */
#include <stdio.h>
#include <string.h>

#include <gpupool/gpupool.h>

static int fail(const char *what, int rc) {
  fprintf(stderr, "consumer: %s: %s (%s)\n", what, gpupool_last_error(), gpupool_err_name(rc));
  return 1;
}

int main(int argc, char **argv) {
  gpupool_client *a = NULL, *b = NULL;
  gpupool_buffer *w = NULL, *r = NULL;
  const size_t n = 1 << 20;
  unsigned char *p;
  int rc;

  if (argc != 2) {
    fprintf(stderr, "usage: consumer SOCKET\n");
    return 2;
  }
  if ((rc = gpupool_client_connect(argv[1], "install-consumer", 5000, &a)) != 0)
    return fail("connect", rc);
  if ((rc = gpupool_client_connect(argv[1], "install-consumer-2", GPUPOOL_TIMEOUT_DEFAULT, &b)) != 0)
    return fail("connect", rc);
  if ((rc = gpupool_buffer_alloc(a, NULL, n, 1000, NULL, &w)) != 0)
    return fail("alloc", rc);
  p = gpupool_buffer_ptr(w);
  for (size_t i = 0; i < n; i++)
    p[i] = (unsigned char)(i * 7 + 3);
  if ((rc = gpupool_buffer_publish(w, "install/consumer", NULL, NULL, NULL)) != 0)
    return fail("publish", rc);
  if ((rc = gpupool_buffer_get(b, "install/consumer", 0, 1000, GPUPOOL_READ_ONLY, NULL, &r, NULL)) != 0)
    return fail("get", rc);
  p = gpupool_buffer_ptr(r);
  for (size_t i = 0; i < n; i++)
    if (p[i] != (unsigned char)(i * 7 + 3)) {
      fprintf(stderr, "consumer: byte %zu differs\n", i);
      return 1;
    }
  gpupool_buffer_release(r, NULL);
  gpupool_buffer_release(w, NULL);
  gpupool_name_unpublish(a, "install/consumer");
  gpupool_client_disconnect(b);
  gpupool_client_disconnect(a);
  printf("consumer: libgpupool-client %s: %zu bytes shared and read back\n",
         gpupool_version_string(), n);
  return 0;
}
