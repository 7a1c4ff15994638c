/*
 * A cmocka test file's main in one line: TS_RUN_TESTS(setup, teardown, test_a, test_b, ...)
 * runs the listed tests, each between setup and teardown (either may be NULL), as the group
 * "tests", and gives cmocka's verdict. Each test keeps its own name in cmocka's output. What
 * a file's main has of its own is its list; the array of CMUnitTest rows that repeated the
 * same fixtures on every line is built here.
 */
#ifndef GPUPOOL_TEST_RUN_TESTS_H
#define GPUPOOL_TEST_RUN_TESTS_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

/* names: the tests' names as the preprocessor spelled the list ("a, b, c"); n of them. */
static inline int ts_run_tests(const char *names, const CMUnitTestFunction *fns, size_t n, CMFixtureFunction setup,
                               CMFixtureFunction teardown) {
  struct CMUnitTest *tests = calloc(n, sizeof *tests);
  char *list = malloc(strlen(names) + 1), *next = list;
  int rc;
  if (!tests || !list) {
    fprintf(stderr, "out of memory for %zu tests\n", n);
    return 1;
  }
  strcpy(list, names);
  for (size_t i = 0; i < n; i++) {
    char *name = next + strspn(next, " \t\n");
    next = name + strcspn(name, ",");
    if (*next)
      *next++ = '\0';
    name[strcspn(name, " \t\n")] = '\0';
    tests[i] = (struct CMUnitTest){name, fns[i], setup, teardown, NULL};
  }
  rc = _cmocka_run_group_tests("tests", tests, n, NULL, NULL);
  free(list);
  free(tests);
  return rc;
}

#define TS_RUN_TESTS(setup, teardown, ...)                                                          \
  ts_run_tests(#__VA_ARGS__, (const CMUnitTestFunction[]){__VA_ARGS__},                            \
               sizeof((const CMUnitTestFunction[]){__VA_ARGS__}) / sizeof(CMUnitTestFunction), setup, \
               teardown)

#endif
