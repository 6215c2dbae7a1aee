/*
 * Preloaded ahead of libfaketime by test_node_clock_jump.py: sleeps on the clocks it leaves
 * alone (FAKETIME_DONT_FAKE_MONOTONIC=1) go straight to the kernel.
 *
 * libfaketime 0.9.10 (Debian 12) translates every clock_nanosleep(TIMER_ABSTIME) deadline
 * as if the clock were faked, CLOCK_MONOTONIC included, and hands the kernel a negative
 * time: Python 3.11's time.sleep (and so subprocess's wait with a timeout) fails with
 * EINVAL (wolfcw/libfaketime#426). A wall clock stepped by settimeofday leaves
 * CLOCK_MONOTONIC alone, so a sleep on it needs no translation; CLOCK_REALTIME's still go
 * through libfaketime.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int clock_nanosleep(clockid_t clock, int flags, const struct timespec *request,
                    struct timespec *remain)
{
    static int (*next)(clockid_t, int, const struct timespec *, struct timespec *);

    if (clock != CLOCK_REALTIME && clock != CLOCK_TAI) {
        /* clock_nanosleep returns the error, not -1 with errno */
        return syscall(SYS_clock_nanosleep, clock, flags, request, remain) == 0 ? 0 : errno;
    }
    if (next == NULL) {
        next = (int (*)(clockid_t, int, const struct timespec *, struct timespec *))
            dlsym(RTLD_NEXT, "clock_nanosleep");
        if (next == NULL) {
            return ENOSYS;
        }
    }
    return next(clock, flags, request, remain);
}
