// XXH3 as ckptd uses it (checksums of tensor bytes): xxhash's runtime-
// dispatched entry points on x86-64, which pick AVX2 or AVX-512 when the CPU
// has them (about 2.2x the SSE2 build in L2 on the dev VM: 38 vs 17 GB/s),
// the plain ones elsewhere. Same hashes either way.
#ifndef CKPTD_CORE_XXH3_H_
#define CKPTD_CORE_XXH3_H_

#include <xxhash.h>
#if defined(__x86_64__)
#include <xxh_x86dispatch.h>  // maps XXH3_64bits* to the _dispatch versions
#endif

#endif  // CKPTD_CORE_XXH3_H_
