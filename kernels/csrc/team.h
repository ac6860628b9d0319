/* OpenMP teams that shrink to one thread while the CPU is shared. A parallel region ends at a barrier, so on a
 * machine whose cores other processes also use, a decode step's ~150 short regions (tens of microseconds of work
 * each) each wait for the descheduled team member to be run again: a scheduler's slice, milliseconds, every time
 * (docs/benchmarks.md has the measurements). So each region times the calling thread's own share and its wait at
 * the barrier after it; a wait both long (TEAM_LATE_SECONDS) and several times the share says a member was not
 * running, and the library's regions run on the calling thread alone for a stretch of time, then two or more
 * threads are tried again. A stretch that ends in another late wait is followed by one twice as long (up to
 * TEAM_SOLO_MAX_SECONDS), so a core held for long costs one late wait a second at most, while a lone interruption
 * on a quiet machine costs one short stretch: counted in regions, a stretch of a large model's millisecond products
 * lasted seconds at half speed. Every kernel splits its work by outputs, each output computed whole by one thread,
 * so the results are the same bits on any team. */
#ifndef OFFLOAD_TEAM_H
#define OFFLOAD_TEAM_H

#include <omp.h>

#define TEAM_LATE_SECONDS 2e-4    /* a barrier wait this long is a member descheduled, not a share uneven */
#define TEAM_LATE_RATIO 4.0       /* ... and this many times the calling thread's own share */
#define TEAM_SOLO_SECONDS 0.02    /* the first stretch on one thread after such a wait (two small-model steps) */
#define TEAM_SOLO_MAX_SECONDS 1.0 /* the longest, after late waits that keep coming back */

/* this library's stretch on one thread: its end and its length, in omp_get_wtime() seconds */
static double team_solo_until, team_solo_stretch = TEAM_SOLO_SECONDS;

typedef struct {
    int threads;        /* the team's size for this region */
    double start, done; /* seconds: the region's start, the calling thread's share done */
} team;

/* The team for a region that `threads` threads would run. */
static inline team team_begin(int threads) {
    team t = {threads, 0.0, 0.0};
    if (threads < 2) return t;
    double until;
    __atomic_load(&team_solo_until, &until, __ATOMIC_RELAXED);
    t.start = omp_get_wtime();
    if (t.start < until) t.threads = 1;
    return t;
}

/* Inside the region, after the thread's share of a `nowait` loop: the calling thread notes the time. */
static inline void team_share_done(team *t) {
    if (t->threads > 1 && omp_get_thread_num() == 0) t->done = omp_get_wtime();
}

/* After the region: a long wait at its barrier starts a stretch on one thread, twice the last one's length when
 * that one ended less than its own length ago. */
static inline void team_end(const team *t) {
    if (t->threads < 2) return;
    const double now = omp_get_wtime(), waited = now - t->done, own = t->done - t->start;
    if (waited <= TEAM_LATE_SECONDS || waited <= TEAM_LATE_RATIO * own) return;
    double until, stretch;
    __atomic_load(&team_solo_until, &until, __ATOMIC_RELAXED);
    __atomic_load(&team_solo_stretch, &stretch, __ATOMIC_RELAXED);
    stretch = now < until + stretch ? (2 * stretch < TEAM_SOLO_MAX_SECONDS ? 2 * stretch : TEAM_SOLO_MAX_SECONDS)
                                    : TEAM_SOLO_SECONDS;
    until = now + stretch;
    __atomic_store(&team_solo_stretch, &stretch, __ATOMIC_RELAXED);
    __atomic_store(&team_solo_until, &until, __ATOMIC_RELAXED);
}

#endif
