/*
 * The rows of GPUPOOL__REQUEST_MAP (requests.h) as data, and the lookup from a oneof case to
 * its row, for the daemon (every request goes through it) and gpupoolctl.
 */
#include "requests.h"

const gpupool__request_kind gpupool__request_kinds[GPUPOOL__NREQUESTS] = {
#define ROW(CASE, name, Message, flags) {GPUPOOL__WIRE__REQUEST__BODY_##CASE, #name, #Message, flags},
    GPUPOOL__REQUEST_MAP(ROW)
#undef ROW
};

/* Row index + 1 of each oneof case (0: no row), so that a lookup on every request is one load. */
static const signed char index_of_case[] = {
#define INDEX(CASE, name, Message, flags) [GPUPOOL__WIRE__REQUEST__BODY_##CASE] = GPUPOOL__REQ_##CASE + 1,
    GPUPOOL__REQUEST_MAP(INDEX)
#undef INDEX
};

int gpupool__request_index(int body_case) {
  if (body_case < 0 || body_case >= (int)sizeof index_of_case)
    return -1;
  return index_of_case[body_case] - 1;
}

const char *gpupool__request_name(int body_case) {
  int i = gpupool__request_index(body_case);
  return i < 0 ? "unknown" : gpupool__request_kinds[i].name;
}
