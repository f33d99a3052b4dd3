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
