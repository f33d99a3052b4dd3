/* Intake's side of the cache: links a validated file or staged set into cache/deltas/s<step>/<node>/
 * under the node directory's lock (flock), so the duplicate check of both layouts and the links that
 * follow are one step for uploads, hub intakes and a set's several links alike; a set's shards go
 * first and its index last (an index in the cache means its set is complete).  intake.c and
 * intake_set.c validate what comes here. */
#include "intake_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fsutil.h"
#include "st_index.h"
#include "store.h"

char *intake_cache_path(const char *state_dir, const delta_info *info)
{
    return store_path_cached_delta(state_dir, info->base_outer_step, info->node_id, info->local_step);
}

/* The node's cache directory, created if needed, opened and locked (flock): every link into it
 * runs under this lock, so the existence checks of both layouts and the links that follow are one
 * step for the uploads, the hub intakes and a set's several links alike.  Returns the descriptor
 * (closing it releases the lock) or -1 with err set. */
static int lock_node_dir(const char *dir, dl_error *err)
{
    /* async mode's cleanup removes an empty node directory under this lock (store.c, sweep_empty_cache):
     * one removed before it was opened, or after, is made again */
    for (int attempt = 0;; attempt++) {
        int fd;
        struct stat sb;
        if (fsu_mkdirs(dir, err) != 0) {
            if (attempt < 3)
                continue;
            return -1;
        }
        if ((fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0) {
            if (errno == ENOENT && attempt < 3)
                continue;
            dl_fail_errno(err, errno, "opening the cache directory %s", dir);
            return -1;
        }
        while (flock(fd, LOCK_EX) != 0) {
            if (errno != EINTR) {
                dl_fail_errno(err, errno, "locking the cache directory %s", dir);
                close(fd);
                return -1;
            }
        }
        if (fstat(fd, &sb) == 0 && sb.st_nlink == 0 && attempt < 3) {
            close(fd);
            continue;
        }
        return fd;
    }
}

/* Whether this node's delta of this local step is cached in either layout (the lock is held). */
int intake__cached_in_any_layout(const char *state_dir, const delta_info *info)
{
    char *single = intake_cache_path(state_dir, info), *index = intake_cache_index_path(state_dir, info);
    int found = (single != NULL && access(single, F_OK) == 0) || (index != NULL && access(index, F_OK) == 0);

    free(single);
    free(index);
    return found;
}

static char *dir_of(const char *path)
{
    char *dir = strdup(path);

    if (dir != NULL)
        *strrchr(dir, '/') = '\0';
    return dir;
}

intake_status intake_link_into_cache(const char *state_dir, const delta_info *info, const char *tmp,
                                     char **cache_path, dl_error *err)
{
    char *dir = NULL, *path;
    intake_status st;
    int lock = -1;

    *cache_path = NULL;
    path = intake_cache_path(state_dir, info);
    if (path == NULL || (dir = dir_of(path)) == NULL) {
        dl_fail_errno(err, ENOMEM, "out of memory");
        st = INTAKE_IO;
        goto out;
    }
    if ((lock = lock_node_dir(dir, err)) < 0) {
        st = INTAKE_IO;
        goto out;
    }
    if (intake__cached_in_any_layout(state_dir, info)) {    /* a set of the same step counts too */
        st = INTAKE_DUPLICATE;
        goto out;
    }
    if (link(tmp, path) != 0) {
        int e = errno;
        if (e == EEXIST) {
            st = INTAKE_DUPLICATE;
            goto out;
        }
        dl_fail_errno(err, e, "linking the delta into the cache");
        st = INTAKE_IO;
        goto out;
    }
    if (fsu_fsync_parent(path, err) != 0) {
        unlink(path);
        st = INTAKE_IO;
        goto out;
    }
    *cache_path = path;
    path = NULL;
    st = INTAKE_OK;
out:
    if (lock >= 0)
        close(lock);
    free(dir);
    free(path);
    return st;
}

char *intake_cache_index_path(const char *state_dir, const delta_info *info)
{
    return store_path_cached_index(state_dir, info->base_outer_step, info->node_id, info->local_step);
}

/* Removes the first n shards of a set from the cache directory (a link that failed half way). */
static void unlink_shards(const char *cache_dir, const st_index *ix, uint32_t n)
{
    char name[ST_INDEX_BASE_MAX + 40], *p;

    for (uint32_t i = 0; i < n; i++) {
        st_index_shard_name(ix->base, i, ix->nshards, name, sizeof(name));
        if (asprintf(&p, "%s/%s", cache_dir, name) >= 0) {
            unlink(p);
            free(p);
        }
    }
}

/* Links dir/<name> to cache_dir/<name>.  A shard already there without its index (the lock is
 * held and the index is absent) is what a link cut short by a crash left: it is replaced. */
static int link_one(const char *dir, const char *cache_dir, const char *name, int replace, dl_error *err)
{
    char *from = NULL, *to = NULL;
    int rc = 0;

    if (asprintf(&from, "%s/%s", dir, name) < 0 || asprintf(&to, "%s/%s", cache_dir, name) < 0) {
        free(from);
        return dl_fail_errno(err, ENOMEM, "out of memory");
    }
    if (link(from, to) != 0 && !(replace && errno == EEXIST && unlink(to) == 0 && link(from, to) == 0))
        rc = errno == EEXIST ? -EEXIST : dl_fail_errno(err, errno, "linking %s into the cache", name);
    free(from);
    free(to);
    return rc;
}

intake_status intake_link_set_into_cache(const char *state_dir, const delta_info *info, const char *dir,
                                         const st_index *ix, char **cache_path, dl_error *err)
{
    char *index = NULL, *cache_dir = NULL, base[ST_INDEX_BASE_MAX + 1], name[ST_INDEX_BASE_MAX + 40];
    uint32_t linked = 0;
    intake_status st = INTAKE_IO;
    int lock = -1, rc;

    *cache_path = NULL;
    /* the index's text names its shards by its base: the cached set keeps the base it was checked with */
    if (snprintf(base, sizeof(base), "delta_%" PRIu64, info->local_step) >= (int)sizeof(base) ||
        strcmp(base, ix->base) != 0) {
        dl_fail(err, DL_E_INVALID_PATH, NULL, 0, "the set's base \"%s\" is not %s, the name its step caches under",
                ix->base, base);
        return INTAKE_INVALID;
    }
    index = intake_cache_index_path(state_dir, info);
    if (index == NULL || (cache_dir = dir_of(index)) == NULL) {
        dl_fail_errno(err, ENOMEM, "out of memory");
        goto out;
    }
    if ((lock = lock_node_dir(cache_dir, err)) < 0)
        goto out;
    if (intake__cached_in_any_layout(state_dir, info)) {
        st = INTAKE_DUPLICATE;
        goto out;
    }
    for (; linked < ix->nshards; linked++) {
        st_index_shard_name(ix->base, linked, ix->nshards, name, sizeof(name));
        if (link_one(dir, cache_dir, name, 1, err) != 0)
            goto out;
    }
    /* the shards' names are durable before the index names them: after a crash an index is only
     * ever found next to its complete set */
    if (fsu_fsync_parent(index, err) != 0)
        goto out;
    if (snprintf(name, sizeof(name), "%s" ST_INDEX_SUFFIX, ix->base) >= (int)sizeof(name)) {
        dl_fail(err, DL_E_INVALID_PATH, NULL, 0, "the set's base is too long");
        goto out;
    }
    if ((rc = link_one(dir, cache_dir, name, 0, err)) != 0) {
        if (rc == -EEXIST)      /* cannot happen under the lock, but never replace an index */
            st = INTAKE_DUPLICATE;
        goto out;
    }
    if (fsu_fsync_parent(index, err) != 0) {
        unlink(index);
        goto out;
    }
    *cache_path = index;
    index = NULL;
    linked = 0;
    st = INTAKE_OK;
out:
    if (st != INTAKE_OK && st != INTAKE_DUPLICATE)
        unlink_shards(cache_dir, ix, linked);
    if (lock >= 0)
        close(lock);
    free(cache_dir);
    free(index);
    return st;
}
