#include "test.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "auth.h"

/* A token file as an operator keeps it: readable by its owner only (auth_load refuses any other mode). */
static int write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (f == NULL)
        return -1;
    fputs(text, f);
    fclose(f);
    return chmod(path, 0600);
}

TEST(auth_tokens_per_node_and_admin)
{
    auth_table t = {0};
    dl_error err;
    CHECK_EQ(write_file(test_path("tok"), "# workers\nw1 aaaaaaaaaaaaaaaa1\nw2 bbbbbbbbbbbbbbbb2\n\n* cccccccccccccccc3\n"), 0);
    CHECK_EQ(auth_load(&t, test_path("tok"), &err), 0);
    CHECK_EQ(t.n, 3);
    CHECK_EQ(auth_check(&t, "Bearer aaaaaaaaaaaaaaaa1", "w1"), AUTH_OK);
    CHECK_EQ(auth_check(&t, "bearer   aaaaaaaaaaaaaaaa1 ", "w1"), AUTH_OK);
    CHECK_EQ(auth_check(&t, "Bearer aaaaaaaaaaaaaaaa1", "w2"), AUTH_WRONG_NODE);
    CHECK_EQ(auth_check(&t, "Bearer cccccccccccccccc3", "anyone"), AUTH_OK);
    CHECK_EQ(auth_check(&t, "Bearer aaaaaaaaaaaaaaaa", "w1"), AUTH_BAD_TOKEN);     /* a prefix is not a match */
    CHECK_EQ(auth_check(&t, "Bearer aaaaaaaaaaaaaaaa1x", "w1"), AUTH_BAD_TOKEN);
    CHECK_EQ(auth_check(&t, NULL, "w1"), AUTH_MISSING);
    CHECK_EQ(auth_check(&t, "Basic dXNlcjpwYXNz", "w1"), AUTH_MISSING);
    auth_free(&t);
}

TEST(auth_bad_file_keeps_previous_table)
{
    auth_table t = {0};
    dl_error err;
    CHECK_EQ(write_file(test_path("good"), "w1 aaaaaaaaaaaaaaaa1\n"), 0);
    CHECK_EQ(auth_load(&t, test_path("good"), &err), 0);
    CHECK_EQ(write_file(test_path("short"), "w1 short\n"), 0);
    CHECK(auth_load(&t, test_path("short"), &err) < 0);
    CHECK_EQ(write_file(test_path("badid"), "../x aaaaaaaaaaaaaaaa1\n"), 0);
    CHECK(auth_load(&t, test_path("badid"), &err) < 0);
    CHECK_EQ(write_file(test_path("extra"), "w1 aaaaaaaaaaaaaaaa1 more\n"), 0);
    CHECK(auth_load(&t, test_path("extra"), &err) < 0);
    CHECK_EQ(write_file(test_path("empty"), "# nothing\n"), 0);
    CHECK(auth_load(&t, test_path("empty"), &err) < 0);
    CHECK(auth_load(&t, test_path("missing"), &err) < 0);
    CHECK_EQ(t.n, 1);
    CHECK_EQ(auth_check(&t, "Bearer aaaaaaaaaaaaaaaa1", "w1"), AUTH_OK);
    auth_free(&t);
}

TEST(auth_token_file_readable_by_others_is_refused)
{
    auth_table t = {0};
    dl_error err;
    CHECK_EQ(write_file(test_path("open"), "w1 aaaaaaaaaaaaaaaa1\n"), 0);
    CHECK_EQ(chmod(test_path("open"), 0640), 0);
    CHECK(auth_load(&t, test_path("open"), &err) < 0);
    CHECK(strstr(err.message, "chmod 600") != NULL);
    CHECK_EQ(chmod(test_path("open"), 0604), 0);
    CHECK(auth_load(&t, test_path("open"), &err) < 0);
    CHECK_EQ(chmod(test_path("open"), 0400), 0);
    CHECK_EQ(auth_load(&t, test_path("open"), &err), 0);
    CHECK_EQ(t.n, 1);
    auth_free(&t);
}
