#include "test.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mapread.h"

static int sum_bytes(void *arg)
{
    const unsigned char **p = arg;
    int s = 0;
    for (size_t i = 0; i < (4u << 20); i += 4096)
        s += p[0][i];
    return s;
}

/* A window of a file read in place: the bytes of the file; when the file is cut short under the
 * mapping, the guarded read returns MAPREAD_BUS and the process goes on (a second time too: the
 * handler stays armed after a jump out of it). */
TEST(mapread_truncated_file_under_a_window_is_a_failed_read_not_a_crash)
{
    const char *path = test_path("mapped");
    const size_t size = 6u << 20;
    unsigned char *data = malloc(size);
    int fd;

    CHECK(data != NULL);
    for (size_t i = 0; i < size; i++)
        data[i] = (unsigned char)(i / 4096 % 7 + 1);
    fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0);
    CHECK(write(fd, data, size) == (ssize_t)size);
    CHECK(mapread_ready());
    for (int round = 0; round < 2; round++) {
        void *base;
        size_t maplen;
        /* from byte 1 MiB + 100 on: the window widens to whole 2 MiB units, the address is byte 100's */
        const unsigned char *p = mapread_map(fd, size, (1u << 20) + 100, 4u << 20, 1, &base, &maplen);
        CHECK(p != NULL);
        CHECK(maplen >= (4u << 20) + 100);
        CHECK(memcmp(p, data + (1u << 20) + 100, 4u << 20) == 0);
        int want = 0;
        for (size_t i = 0; i < (4u << 20); i += 4096)
            want += data[(1u << 20) + 100 + i];
        CHECK_EQ(mapread_guarded(sum_bytes, &p), want);
        CHECK(ftruncate(fd, 2u << 20) == 0);      /* pages past 2 MiB are gone */
        CHECK_EQ(mapread_guarded(sum_bytes, &p), MAPREAD_BUS);
        mapread_unmap(base, maplen);
        CHECK(pwrite(fd, data, size, 0) == (ssize_t)size);
    }
    close(fd);
    free(data);
}

/* The Rss line (KiB) of this process's mapping that starts at base, from /proc/self/smaps: the pages
 * whose page tables are set up.  -1 when not found. */
static long mapping_rss_kib(const void *base)
{
    char line[512];
    unsigned long start, end;
    long rss = -1;
    int in = 0;
    FILE *f = fopen("/proc/self/smaps", "r");

    if (f == NULL)
        return -1;
    while (fgets(line, sizeof(line), f) != NULL) {
        if (sscanf(line, "%lx-%lx ", &start, &end) == 2)    /* a mapping's first line */
            in = start == (unsigned long)(uintptr_t)base;
        else if (in && strncmp(line, "Rss:", 4) == 0)
            rss = atol(line + 4);
    }
    fclose(f);
    return rss;
}

/* A reserved window holds no page tables until populated, populating sets up the range asked (and no
 * more than the folios under it), dropping takes a range out of RSS again, and a dropped page read
 * again reads the file's bytes. */
TEST(mapread_reserved_window_is_populated_and_dropped_as_asked)
{
    const char *path = test_path("window");
    const size_t size = 16u << 20, unit = MAPREAD_UNIT;
    unsigned char *data = malloc(size);
    void *base;
    size_t maplen;
    int fd;

    CHECK(data != NULL);
    for (size_t i = 0; i < size; i++)
        data[i] = (unsigned char)(i * 31 / 4096 + 3);
    fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0);
    CHECK(write(fd, data, size) == (ssize_t)size);
    CHECK(fsync(fd) == 0);
    const unsigned char *p = mapread_reserve(fd, size, unit + 100, 5 * unit, 1, &base, &maplen);
    CHECK(p != NULL);
    CHECK(p == (const unsigned char *)base + 100);      /* from the unit that holds byte unit + 100 */
    CHECK_EQ(mapping_rss_kib(base), 0);
    mapread_populate(p, 3 * unit);
    long populated = mapping_rss_kib(base);
    /* at least the 6 MiB asked; no more than the units under them (2 MiB folios are mapped whole) */
    CHECK(populated >= (long)(3 * unit / 1024) && populated <= (long)(4 * unit / 1024));
    mapread_drop(base, 0, 2 * unit);
    long left = mapping_rss_kib(base);
    CHECK(left <= populated - (long)(2 * unit / 1024) + 4 && left >= (long)(unit / 1024));
    CHECK(memcmp(p, data + unit + 100, 5 * unit) == 0);  /* dropped and never-populated pages read alike */
    mapread_unmap(base, maplen);
    close(fd);
    free(data);
}
