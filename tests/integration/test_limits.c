/*
 * Limits from the config, tested at the limit and one past it: allocations and bytes per
 * client, names, clients. Each refusal must name the limit and leave the daemon serving.
 */
#include "harness.h"

static th_daemon D;

static int setup(void **state) {
  (void)state;
  th_prepare(&D);
  th_write_conf(&D, "# limits under test\n[daemon]\nmax_allocs_per_client = 4\nmax_bytes_per_client = 1M\n"
                    "max_names = 3\nmax_clients = 6\n"
                    "[pool default]\nkind = host\ncapacity = 64M\nslab_size = 4M\n");
  th_start(&D, 1, NULL);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  th_wait_idle(&D, 2000);
  th_stop(&D);
  return 0;
}

static void test_allocs_per_client(void **state) {
  gpupool_client *c = th_connect(&D, "limited");
  gpupool_buffer *b[5];
  (void)state;
  for (int i = 0; i < 4; i++)
    assert_int_equal(gpupool_buffer_alloc(c, NULL, 1000, 0, NULL, &b[i]), 0);
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 1000, 0, NULL, &b[4]), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool_last_error(), "max_allocs_per_client"));
  assert_int_equal(gpupool_buffer_release(b[0], NULL), 0);
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 1000, 0, NULL, &b[0]), 0);
  for (int i = 0; i < 4; i++)
    assert_int_equal(gpupool_buffer_release(b[i], NULL), 0);
  gpupool_client_disconnect(c);
}

static void test_bytes_per_client(void **state) {
  gpupool_client *c = th_connect(&D, "limited");
  gpupool_buffer *a, *b;
  (void)state;
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 1u << 20, 0, NULL, &a), 0); /* exactly the limit */
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 1, 0, NULL, &b), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool_last_error(), "max_bytes_per_client"));
  assert_int_equal(gpupool_buffer_release(a, NULL), 0);
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 1, 0, NULL, &b), 0);
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
}

static void test_names(void **state) {
  gpupool_client *c = th_connect(&D, "namer");
  gpupool_buffer *b;
  (void)state;
  assert_int_equal(gpupool_buffer_alloc(c, NULL, 64, 0, NULL, &b), 0);
  assert_int_equal(gpupool_buffer_publish(b, "n1", NULL, NULL, NULL), 0);
  assert_int_equal(gpupool_buffer_publish(b, "n2", NULL, NULL, NULL), 0);
  assert_int_equal(gpupool_buffer_publish(b, "n3", NULL, NULL, NULL), 0);
  assert_int_equal(gpupool_buffer_publish(b, "n4", NULL, NULL, NULL), GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool_last_error(), "max_names"));
  assert_int_equal(gpupool_name_unpublish(c, "n1"), 0);
  assert_int_equal(gpupool_buffer_publish(b, "n4", NULL, NULL, NULL), 0);
  for (int i = 2; i <= 4; i++) {
    char n[8];
    snprintf(n, sizeof n, "n%d", i);
    assert_int_equal(gpupool_name_unpublish(c, n), 0);
  }
  assert_int_equal(gpupool_buffer_release(b, NULL), 0);
  gpupool_client_disconnect(c);
}

static void test_max_clients(void **state) {
  gpupool_client *c[7];
  int rc;
  (void)state;
  for (int i = 0; i < 6; i++)
    c[i] = th_connect(&D, "many");
  rc = gpupool_client_connect(D.sock, "one-too-many", GPUPOOL_TIMEOUT_DEFAULT, &c[6]);
  assert_int_equal(rc, GPUPOOL_ELIMIT);
  assert_non_null(strstr(gpupool_last_error(), "max_clients"));
  gpupool_client_disconnect(c[5]);
  th_sleep_ms(50);
  c[5] = th_connect(&D, "room-again");
  for (int i = 0; i < 6; i++)
    gpupool_client_disconnect(c[i]);
}

int main(void) {
  return TS_RUN_TESTS(setup, teardown, test_allocs_per_client, test_bytes_per_client, test_names, test_max_clients);
}
