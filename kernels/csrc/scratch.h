/* Memory a kernel needs only during its call (sums of a row's inputs, inputs rearranged, attention scores): on the
 * calling thread's stack where it fits, which a decode step's few rows do, else from the heap. Allocating it in
 * Python as a tensor cost about 1 us a buffer, of a one-row product of 10-20 us on the small matrices of a 135M model
 * (2-core AMD EPYC). A kernel's OpenMP threads share the caller's frame, so they read it there. */
#ifndef OFFLOAD_SCRATCH_H
#define OFFLOAD_SCRATCH_H

#include <stdlib.h>

#define STACK_SCRATCH 16384 /* bytes: the block sums of 32 rows of 4096 inputs; Q4_0's pairs' inputs of 2 such rows */

/* `bytes` of scratch: `stack` (STACK_SCRATCH bytes of the caller's frame) where they fit, else memory the caller
 * gives back with free(*heap) (NULL where nothing was allocated, which free ignores); NULL where the heap has none,
 * which the kernel reports by returning non-zero, computing nothing */
static inline void *scratch(void *stack, size_t bytes, void **heap) {
    if (bytes <= STACK_SCRATCH) return stack;
    *heap = malloc(bytes);
    return *heap;
}

#endif
