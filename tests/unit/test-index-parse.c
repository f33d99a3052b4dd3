/* core/index_parse: one parse of one version of a set's index, its verdicts, its version check (ctime
 * included) and the process-wide budget of kept parses; st_index_clone, which intake hands a set. */
#include "test.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fsutil.h"
#include "index_parse.h"
#include "st_index.h"

#define GOOD "{\"metadata\": {\"total_size\": 8, \"node_id\": \"w1\"}, \"weight_map\": {" \
             "\"b\": \"d-00002-of-00002.safetensors\", \"a\": \"d-00001-of-00002.safetensors\"}}"

static int write_text(const char *path, const char *text)
{
    dl_error err;
    return fsu_write_atomic(path, text, strlen(text), &err);
}

/* index_parse_read of path for base "d" (NULL when it cannot be opened). */
static index_parse *parse_path(const char *path)
{
    index_parse *p = NULL;
    struct stat sb;
    int fd = open(path, O_RDONLY | O_CLOEXEC);

    if (fd < 0)
        return NULL;
    if (fstat(fd, &sb) != 0 || index_parse_read(fd, &sb, "d", &p) != 0)
        p = NULL;
    close(fd);
    return p;
}

TEST(index_parse_verdicts)
{
    const char *path = test_path("d.safetensors.index.json");
    dl_error err;

    CHECK_EQ(write_text(path, GOOD), 0);
    index_parse *p = parse_path(path);
    CHECK(p != NULL);
    CHECK_EQ(p->status, INDEX_PARSED);
    CHECK_EQ(p->nshards, 2);
    CHECK(p->ix != NULL && st_index_find(p->ix, "a", 1) != NULL);
    CHECK_EQ(p->len, strlen(GOOD));
    CHECK(memcmp(p->text, GOOD, p->len) == 0);      /* the bytes parsed, for the staged copy */
    CHECK(p->bytes > p->len);
    CHECK(!p->kept);
    index_parse_release(p);

    /* malformed: refused for good; cut short: refused as still being written */
    CHECK_EQ(write_text(path, "{\"metadata\": {\"total_size\": 8}, \"weight_map\": {\"a\": [1]}}"), 0);
    p = parse_path(path);
    CHECK(p != NULL && p->status == INDEX_REFUSED && p->ix == NULL && p->nshards == 0 && !p->incomplete);
    index_parse_error(p, &err);
    CHECK_EQ(err.code, DL_E_INVALID_HEADER_DESERIALIZATION);
    CHECK(err.message[0] != '\0');
    index_parse_release(p);
    CHECK_EQ(write_text(path, "{\"metadata\": {\"total_size\": 8}, \"weight_"), 0);
    p = parse_path(path);
    CHECK(p != NULL && p->status == INDEX_REFUSED && p->incomplete);
    CHECK(strstr(p->message, "not complete yet") != NULL);
    index_parse_release(p);

    /* over the format's cap: not read at all */
    int fd = open(path, O_WRONLY | O_TRUNC | O_CLOEXEC);
    CHECK(fd >= 0);
    CHECK_EQ(ftruncate(fd, (off_t)ST_INDEX_MAX_BYTES + 1), 0);
    close(fd);
    p = parse_path(path);
    CHECK(p != NULL && p->status == INDEX_UNREAD && p->code == DL_E_HEADER_TOO_LARGE && p->text == NULL);
    index_parse_release(p);
}

TEST(index_parse_version_is_the_identity_with_ctime)
{
    const char *path = test_path("d.safetensors.index.json");
    struct stat sb;

    CHECK_EQ(write_text(path, GOOD), 0);
    index_parse *p = parse_path(path);
    CHECK(p != NULL);
    CHECK_EQ(lstat(path, &sb), 0);
    CHECK(index_parse_is_version(p, &sb));
    /* a chmod (or a rewrite with size and mtime put back) moves only ctime: another version */
    for (int i = 0; i < 1000 && index_parse_is_version(p, &sb); i++) {
        CHECK_EQ(chmod(path, i % 2 ? 0644 : 0600), 0);
        CHECK_EQ(lstat(path, &sb), 0);
        if (index_parse_is_version(p, &sb))
            usleep(1000);       /* the filesystem's clock has not ticked yet */
    }
    CHECK_EQ((int64_t)sb.st_mtim.tv_sec * 1000000000 + sb.st_mtim.tv_nsec, p->ident.mtime_ns);
    CHECK(!index_parse_is_version(p, &sb));
    index_parse_release(p);
}

TEST(index_parse_kept_parses_stay_within_one_budget)
{
    const char *path = test_path("d.safetensors.index.json");
    size_t base = index_parse_kept_bytes();

    CHECK_EQ(write_text(path, GOOD), 0);
    index_parse *a = parse_path(path), *b = parse_path(path);
    CHECK(a != NULL && b != NULL);
    /* two parses that each take just over half of the budget: the first is kept, the second is
     * dropped to its verdict (no eviction of the first) */
    a->bytes = b->bytes = INDEX_PARSE_KEPT_MAX / 2 + 1;
    CHECK_EQ(index_parse_keep(a), 1);
    CHECK_EQ(index_parse_kept_bytes(), base + INDEX_PARSE_KEPT_MAX / 2 + 1);
    CHECK_EQ(index_parse_keep(b), 0);
    CHECK(a->ix != NULL && a->kept);
    CHECK(b->ix == NULL && b->text == NULL && b->status == INDEX_PARSED && b->nshards == 2);
    /* the verdict of a kept parse, without the parse (for a node's older set) */
    index_parse *v = index_parse_verdict_of(a);
    CHECK(v != NULL && v->ix == NULL && v->nshards == 2 && !v->kept && index_parse_kept_bytes() > base);
    index_parse_release(v);
    /* shared: the bytes go back with the last reference, not the first */
    index_parse *shared = index_parse_ref(a);
    index_parse_release(a);
    CHECK(index_parse_kept_bytes() > base);
    index_parse_release(shared);
    CHECK_EQ(index_parse_kept_bytes(), base);
    /* now there is room again */
    index_parse *c = parse_path(path);
    CHECK(c != NULL);
    CHECK_EQ(index_parse_keep(c), 1);
    index_parse_release(c);
    index_parse_release(b);
    CHECK_EQ(index_parse_kept_bytes(), base);
}

TEST(index_clone_is_independent_of_its_original)
{
    st_index *ix = NULL, *c;
    dl_error err;

    CHECK_EQ(st_index_parse(GOOD, strlen(GOOD), "d", &ix, &err), 0);
    c = st_index_clone(ix);
    CHECK(c != NULL);
    st_index_free(ix);          /* the clone owns everything it holds */
    CHECK_STR(c->base, "d");
    CHECK_EQ(c->nshards, 2);
    CHECK_EQ(c->total_size, 8);
    CHECK_EQ(c->nentries, 2);
    CHECK_STR(c->entries[0].name, "b");
    CHECK(st_index_find(c, "a", 1) != NULL && st_index_find(c, "a", 1)->shard == 0);
    CHECK_STR(st_index_meta(c, "node_id", NULL), "w1");
    st_index_free(c);
}
