/*
 * main() for the fuzz targets when libFuzzer is not linked (gcc, or a build without
 * GPUPOOL_FUZZ): runs every file named on the command line, or found in a directory named
 * there, through LLVMFuzzerTestOneInput once. ctest replays the seed corpora and every
 * regression input this way on each build; a finding aborts, a run of no input fails.
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz.h"

__attribute__((weak)) int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  return 0;
}

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  uint8_t *buf = NULL;
  long n;
  if (!f || fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
    fprintf(stderr, "replay: cannot read %s: %s\n", path, strerror(errno));
    exit(1);
  }
  buf = malloc(n > 0 ? (size_t)n : 1);
  if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
    fprintf(stderr, "replay: cannot read %s\n", path);
    exit(1);
  }
  fclose(f);
  LLVMFuzzerTestOneInput(buf, (size_t)n);
  free(buf);
  return 1;
}

static int cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int run_path(const char *path) {
  struct stat st;
  DIR *d;
  struct dirent *e;
  char **names = NULL;
  size_t n = 0, cap = 0;
  int runs = 0;
  if (stat(path, &st) != 0)
    return 0; /* a regression directory without inputs yet */
  if (!S_ISDIR(st.st_mode))
    return run_file(path);
  if (!(d = opendir(path))) {
    fprintf(stderr, "replay: cannot open %s: %s\n", path, strerror(errno));
    exit(1);
  }
  while ((e = readdir(d))) {
    char *p;
    if (e->d_name[0] == '.')
      continue;
    if (n == cap && !(names = realloc(names, (cap = cap ? cap * 2 : 64) * sizeof *names)))
      exit(1);
    if (!(p = malloc(strlen(path) + strlen(e->d_name) + 2)))
      exit(1);
    sprintf(p, "%s/%s", path, e->d_name);
    names[n++] = p;
  }
  closedir(d);
  if (n > 1)
    qsort(names, n, sizeof *names, cmp);
  for (size_t i = 0; i < n; i++) {
    struct stat fst;
    if (stat(names[i], &fst) == 0 && S_ISREG(fst.st_mode))
      runs += run_file(names[i]);
    free(names[i]);
  }
  free(names);
  return runs;
}

int main(int argc, char **argv) {
  int runs = 0;
  LLVMFuzzerInitialize(&argc, &argv);
  for (int i = 1; i < argc; i++)
    runs += run_path(argv[i]);
  if (runs == 0) {
    fprintf(stderr, "replay: no inputs found in the paths given\n");
    return 1;
  }
  printf("replay: %d inputs ran without a finding\n", runs);
  return 0;
}
