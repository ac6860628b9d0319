/* OpenMP teams that shrink to one thread while the CPU is shared. A parallel region ends at a barrier, so on a
 * machine whose cores other processes also use, a decode step's ~150 short regions (tens of microseconds of work
 * each) each wait for the descheduled team member to be run again: a scheduler's slice, milliseconds, every time
 * (docs/benchmarks.md has the measurements). So each region times the calling thread's own share and its wait at
 * the barrier after it; a wait both long (TEAM_LATE_SECONDS) and several times the share says a member was not
 * running, and the library's next TEAM_SOLO_CALLS regions run on the calling thread alone, then two or more threads
 * are tried again. Every kernel splits its work by outputs,
 * each output computed whole by one thread, so the results are the same bits on any team. */
#ifndef OFFLOAD_TEAM_H
#define OFFLOAD_TEAM_H

#include <omp.h>

#define TEAM_LATE_SECONDS 2e-4 /* a barrier wait this long is a member descheduled, not a share uneven */
#define TEAM_LATE_RATIO 4.0    /* ... and this many times the calling thread's own share */
#define TEAM_SOLO_CALLS 1024   /* regions run on one thread after such a wait (about 7 decode steps) */

static int team_solo_left; /* this library's regions left to run on one thread */

typedef struct {
    int threads;        /* the team's size for this region */
    double start, done; /* seconds: the region's start, the calling thread's share done */
} team;

/* The team for a region that `threads` threads would run. */
static inline team team_begin(int threads) {
    team t = {threads, 0.0, 0.0};
    if (threads > 1 && __atomic_load_n(&team_solo_left, __ATOMIC_RELAXED) > 0) {
        __atomic_fetch_sub(&team_solo_left, 1, __ATOMIC_RELAXED);
        t.threads = 1;
    }
    if (t.threads > 1) t.start = omp_get_wtime();
    return t;
}

/* Inside the region, after the thread's share of a `nowait` loop: the calling thread notes the time. */
static inline void team_share_done(team *t) {
    if (t->threads > 1 && omp_get_thread_num() == 0) t->done = omp_get_wtime();
}

/* After the region: a long wait at its barrier sends the next TEAM_SOLO_CALLS regions to one thread. */
static inline void team_end(const team *t) {
    if (t->threads < 2) return;
    const double waited = omp_get_wtime() - t->done, own = t->done - t->start;
    if (waited > TEAM_LATE_SECONDS && waited > TEAM_LATE_RATIO * own)
        __atomic_store_n(&team_solo_left, TEAM_SOLO_CALLS, __ATOMIC_RELAXED);
}

#endif
