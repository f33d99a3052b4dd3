#include "test.h"

#include <stdlib.h>
#include <sys/stat.h>

#include "fsutil.h"

TEST(atomic_write_replaces_and_leaves_no_temp)
{
    dl_error err;
    char buf[16] = {0};
    FILE *f;
    CHECK_EQ(fsu_write_atomic(test_path("a.json"), "first", 5, &err), 0);
    CHECK_EQ(fsu_write_atomic(test_path("a.json"), "second", 6, &err), 0);
    f = fopen(test_path("a.json"), "r");
    CHECK(f != NULL);
    CHECK_EQ(fread(buf, 1, sizeof(buf), f), 6);
    fclose(f);
    CHECK_STR(buf, "second");
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "test $(ls -A '%s' | wc -l) -eq 1", test_dir());
    CHECK_EQ(system(cmd), 0);
}

TEST(atomic_write_into_missing_dir_fails_cleanly)
{
    dl_error err;
    CHECK(fsu_write_atomic(test_path("no/such/dir/x"), "x", 1, &err) < 0);
    CHECK_EQ(err.code, DL_E_IO);
    CHECK(strstr(err.message, "No such file") != NULL);
}

TEST(mkdirs_nested)
{
    dl_error err;
    struct stat sb;
    char p[600];
    snprintf(p, sizeof(p), "%s/a/b/c", test_dir());
    CHECK_EQ(fsu_mkdirs(p, &err), 0);
    CHECK_EQ(fsu_mkdirs(p, &err), 0);
    CHECK(stat(p, &sb) == 0 && S_ISDIR(sb.st_mode));
}

/* ---- the shared tree: nothing but directories and regular files, never through a link ---------- */

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

static int open_test_dir(void)
{
    return open(test_dir(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
}

static void put(const char *rel, const char *text)
{
    FILE *f = fopen(test_path(rel), "w");
    if (f != NULL) {
        fputs(text, f);
        fclose(f);
    }
}

TEST(open_file_at_refuses_fifo_without_blocking)
{
    struct stat sb;
    int root = open_test_dir(), fd = 123;
    CHECK(root >= 0);
    CHECK_EQ(mkfifo(test_path("pipe"), 0644), 0);
    /* no writer exists: a blocking open would hang this test (the runner's timeout fails it) */
    CHECK_EQ(fsu_open_file_at(root, "pipe", &fd, &sb), -EINVAL);
    CHECK_EQ(fd, -1);
    CHECK(S_ISFIFO(sb.st_mode));
    CHECK_STR(fsu_kind_name(sb.st_mode), "a FIFO");
    close(root);
}

TEST(open_file_at_refuses_links_dirs_devices)
{
    struct stat sb;
    int root = open_test_dir(), fd;
    CHECK(root >= 0);
    put("real", "x");
    CHECK_EQ(symlink("real", test_path("link")), 0);
    CHECK_EQ(symlink("/dev/zero", test_path("zero")), 0);
    CHECK_EQ(mkdir(test_path("dir"), 0755), 0);
    CHECK_EQ(fsu_open_file_at(root, "link", &fd, &sb), -ELOOP);
    CHECK(S_ISLNK(sb.st_mode));
    CHECK_EQ(fsu_open_file_at(root, "zero", &fd, &sb), -ELOOP);
    CHECK_EQ(fsu_open_file_at(root, "dir", &fd, &sb), -EISDIR);
    CHECK_EQ(fsu_open_file_at(root, "missing", &fd, &sb), -ENOENT);
    CHECK_EQ(fsu_open_file_at(root, "..", &fd, &sb), -EINVAL);
    CHECK_EQ(fsu_open_file_at(root, "dir/../real", &fd, &sb), -EINVAL);
    CHECK_EQ(fsu_open_file_at(root, "real", &fd, &sb), 0);
    CHECK(fd >= 0 && S_ISREG(sb.st_mode) && sb.st_size == 1);
    CHECK(fcntl(fd, F_GETFD) & FD_CLOEXEC);
    close(fd);
    close(root);
}

TEST(open_path_at_never_leaves_the_tree)
{
    struct stat sb;
    char outside[600], target[700];
    int root = open_test_dir(), fd;
    CHECK(root >= 0);
    /* tree/nodes/w1/delta (real), tree/nodes/w9 -> outside/ (holding a delta), tree/nodes/wp -> /proc */
    snprintf(outside, sizeof(outside), "%s/outside", test_dir());
    CHECK_EQ(fsu_mkdirs(test_path("tree/nodes/w1"), &(dl_error){0}), 0);
    CHECK_EQ(mkdir(outside, 0755), 0);
    put("tree/nodes/w1/delta", "in");
    put("outside/delta", "out");
    CHECK_EQ(symlink(outside, test_path("tree/nodes/w9")), 0);
    CHECK_EQ(symlink("/proc/self", test_path("tree/nodes/wp")), 0);
    snprintf(target, sizeof(target), "%s/tree/nodes", test_dir());
    CHECK_EQ(symlink(target, test_path("tree/alias")), 0);
    CHECK_EQ(fsu_open_path_at(root, "tree/nodes/w1/delta", &fd, &sb), 0);
    CHECK(fd >= 0 && sb.st_size == 2);
    close(fd);
    CHECK_EQ(fsu_open_path_at(root, "tree/nodes/w9/delta", &fd, &sb), -ELOOP);
    CHECK_EQ(fd, -1);
    CHECK(S_ISLNK(sb.st_mode));
    CHECK_EQ(fsu_open_path_at(root, "tree/nodes/wp/status", &fd, &sb), -ELOOP);
    CHECK_EQ(fsu_open_path_at(root, "tree/alias/w1/delta", &fd, &sb), -ELOOP);
    CHECK_EQ(fsu_open_path_at(root, "tree/nodes/../nodes/w1/delta", &fd, &sb), -EINVAL);
    CHECK_EQ(fsu_open_path_at(root, "tree//nodes/w1/delta", &fd, &sb), -EINVAL);
    CHECK_EQ(fsu_open_path_at(root, "tree/nodes/w1/delta/x", &fd, &sb), -ENOTDIR);
    close(root);
}

TEST(open_dir_at_refuses_links_and_fifos)
{
    int root = open_test_dir(), fd;
    CHECK(root >= 0);
    CHECK_EQ(mkdir(test_path("d"), 0755), 0);
    CHECK_EQ(symlink("d", test_path("l")), 0);
    CHECK_EQ(mkfifo(test_path("p"), 0644), 0);
    CHECK_EQ(fsu_open_dir_at(root, "l", &fd), -ELOOP);
    CHECK_EQ(fsu_open_dir_at(root, "p", &fd), -ENOTDIR);
    CHECK_EQ(fsu_open_dir_at(root, "d", &fd), 0);
    CHECK(fd >= 0);
    close(fd);
    close(root);
}

TEST(read_small_at_caps_what_it_reads)
{
    char buf[9];
    struct stat sb;
    size_t len = 99;
    int root = open_test_dir();
    CHECK(root >= 0);
    put("small", "12345678");
    put("big", "123456789");
    CHECK_EQ(fsu_read_small_at(root, "small", buf, 8, &len, &sb), 0);
    CHECK_EQ(len, 8);
    CHECK_STR(buf, "12345678");
    CHECK_EQ(fsu_read_small_at(root, "big", buf, 8, &len, &sb), -EFBIG);
    CHECK_EQ(mkfifo(test_path("fifo"), 0644), 0);
    CHECK_EQ(fsu_read_small_at(root, "fifo", buf, 8, &len, &sb), -EINVAL);
    close(root);
}

TEST(write_atomic_at_replaces_a_planted_link_not_its_target)
{
    char buf[16] = {0};
    struct stat sb;
    size_t len;
    int root = open_test_dir();
    CHECK(root >= 0);
    put("victim", "keep");
    CHECK_EQ(symlink("victim", test_path("step.json")), 0);
    CHECK_EQ(fsu_write_atomic_at(root, "step.json", "new", 3), 0);
    CHECK_EQ(fsu_read_small_at(root, "step.json", buf, sizeof(buf) - 1, &len, &sb), 0);
    CHECK_STR(buf, "new");
    CHECK_EQ(fsu_read_small_at(root, "victim", buf, sizeof(buf) - 1, &len, &sb), 0);
    CHECK_STR(buf, "keep");
    CHECK_EQ(fsu_write_atomic_at(root, "../escape", "x", 1), -EINVAL);
    close(root);
}

/* A rewrite whose writer puts size and mtime back is the same version by those, never by ctime. */
TEST(ident_sees_a_rewrite_whose_mtime_was_put_back)
{
    const char *path = test_path("f");
    struct stat sb;
    fsu_ident before;
    CHECK_EQ(fsu_write_atomic(path, "abcdefgh", 8, NULL), 0);
    CHECK_EQ(lstat(path, &sb), 0);
    fsu_ident_of(&sb, &before);
    CHECK_EQ(fsu_ident_check(path, &before), FSU_IDENT_SAME);
    usleep(20000);                      /* past the filesystem clock's tick */
    int fd = open(path, O_WRONLY);
    CHECK(fd >= 0);
    CHECK_EQ(pwrite(fd, "ABCD", 4, 0), 4);
    struct timespec ts[2] = {sb.st_atim, sb.st_mtim};
    CHECK_EQ(futimens(fd, ts), 0);
    close(fd);
    CHECK_EQ(fsu_ident_check(path, &before), FSU_IDENT_CTIME_MOVED);
    /* a record without ctime (an older state's) compares by the rest */
    before.ctime_ns = FSU_CTIME_UNKNOWN;
    CHECK_EQ(fsu_ident_check(path, &before), FSU_IDENT_SAME);
    before.size = 9;
    CHECK_EQ(fsu_ident_check(path, &before), FSU_IDENT_CHANGED);
}
