#include "mapread.h"

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static __thread sigjmp_buf *volatile bus_guard;
static struct sigaction bus_prior;
static pthread_once_t bus_once = PTHREAD_ONCE_INIT;
static int bus_installed;

static void on_sigbus(int sig, siginfo_t *si, void *ctx)
{
    sigjmp_buf *jb = bus_guard;

    (void)sig;
    (void)si;
    (void)ctx;
    if (jb != NULL)
        siglongjmp(*jb, 1);
    sigaction(SIGBUS, &bus_prior, NULL);   /* not ours: the fault repeats under the prior action */
}

static void install_bus_handler(void)
{
    struct sigaction sa;

    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;  /* SIGBUS stays unblocked after the jump out */
    sigemptyset(&sa.sa_mask);
    bus_installed = sigaction(SIGBUS, &sa, &bus_prior) == 0;
}

int mapread_ready(void)
{
    pthread_once(&bus_once, install_bus_handler);
    return bus_installed;
}

int mapread_guarded(int (*fn)(void *arg), void *arg)
{
    sigjmp_buf jb;
    int rc;

    if (sigsetjmp(jb, 0) != 0) {
        bus_guard = NULL;
        return MAPREAD_BUS;
    }
    bus_guard = &jb;
    rc = fn(arg);
    bus_guard = NULL;
    return rc;
}

static const void *map_window(int fd, uint64_t file_size, uint64_t off, uint64_t len, int units, int populate,
                              void **base, size_t *maplen)
{
    const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    const uint64_t unit = units ? MAPREAD_UNIT : page;
    uint64_t start = off - off % unit, end = off + len + (unit - 1) - (off + len + unit - 1) % unit;
    uint64_t limit = file_size + (page - 1) - (file_size + page - 1) % page;

    *base = NULL;
    *maplen = 0;
    if (!mapread_ready() || len == 0)
        return NULL;
    if (end > limit)
        end = limit > off + len ? limit : off + len;
    void *p = mmap(NULL, (size_t)(end - start), PROT_READ, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd,
                   (off_t)start);
    if (p == MAP_FAILED)
        return NULL;
    *base = p;
    *maplen = (size_t)(end - start);
    return (const char *)p + (off - start);
}

const void *mapread_map(int fd, uint64_t file_size, uint64_t off, uint64_t len, int units, void **base,
                        size_t *maplen)
{
    return map_window(fd, file_size, off, len, units, 1, base, maplen);
}

const void *mapread_reserve(int fd, uint64_t file_size, uint64_t off, uint64_t len, int units, void **base,
                            size_t *maplen)
{
    return map_window(fd, file_size, off, len, units, 0, base, maplen);
}

/* Where MADV_POPULATE_READ is unknown (built on older headers, or EINVAL from a kernel before 5.14), the
 * pages are faulted in as they are read instead: the same bytes, more faults. */
void mapread_populate(const void *p, size_t len)
{
#ifdef MADV_POPULATE_READ
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)p - (uintptr_t)p % page, e = (uintptr_t)p + len;

    if (len > 0)
        (void)madvise((void *)a, e - a, MADV_POPULATE_READ);
#else
    (void)p;
    (void)len;
#endif
}

void mapread_drop(void *base, size_t from, size_t to)
{
    if (base != NULL && to > from)
        (void)madvise((char *)base + from, to - from, MADV_DONTNEED);
}

void mapread_unmap(void *base, size_t maplen)
{
    if (base != NULL)
        munmap(base, maplen);
}
