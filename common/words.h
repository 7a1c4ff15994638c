/*
 * Words a user typed, compared with the ones meant: the did-you-mean hints of gpupoold's
 * configuration (unknown keys) and of gpupoolctl (commands, options, names).
 */
#ifndef GPUPOOL_COMMON_WORDS_H
#define GPUPOOL_COMMON_WORDS_H

#include <stddef.h>

/* Edit distance with transpositions (optimal string alignment) of two short words, so that
 * max_clinets is one edit from max_clients. Words are cut at 63 bytes: the distance only
 * ranks suggestions. */
size_t gpupool__edit_distance(const char *a, const char *b);

#endif
