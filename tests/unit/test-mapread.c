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
