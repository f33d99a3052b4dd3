/* Intake of a sharded delta (st_index.h), through its index: the index alone decides stale, future
 * and duplicate; the directory's listing must match it and the shards' sizes fit the delta budget
 * before a byte is copied; then each shard is checked (header against the global and the index,
 * finite values) and copied into a staging directory cache/incoming/intake-XXXXXX, the staged set is
 * checked whole (intake_check_set_dir) and handed to intake_cache.c to be linked in.  intake.c reads
 * the headers and copies the files. */
#include "intake_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fsutil.h"
#include "st_index.h"
#include "store.h"


/* Prefixes err's message with the shard it concerns (the tensor, if any, stays in err->tensor). */
static void name_shard(dl_error *err, const char *shard)
{
    char msg[sizeof(err->message)];

    if (snprintf(msg, sizeof(msg), "shard %s: %s", shard, err->message) < 0)
        return;
    memcpy(err->message, msg, sizeof(msg));
}

/* Opens the directory that holds the index and its shards, reached as a single delta is: in a
 * shared tree from its root one directory at a time without links, else by path (our own files).
 * *name points at the index's file name.  0 or a negative errno (*mode: what a refused entry was). */
static int open_set_dir(const intake_req *r, int *dirfd, const char **name, mode_t *mode)
{
    const char *rel = r->rel_path, *slash;
    char comp[256];
    int cur, next, rc;

    *dirfd = -1;
    *mode = 0;
    if (r->hub_root == NULL || rel == NULL) {
        const char *path = r->src_path;
        char *dir;
        *name = (slash = strrchr(path, '/')) != NULL ? slash + 1 : path;
        if ((dir = slash != NULL ? strndup(path, (size_t)(slash - path) + (slash == path)) : strdup(".")) == NULL)
            return -ENOMEM;
        cur = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        rc = cur < 0 ? -errno : 0;
        free(dir);
        *dirfd = cur;
        return rc;
    }
    if ((cur = open(r->hub_root, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0)
        return -errno;
    while ((slash = strchr(rel, '/')) != NULL) {
        size_t len = (size_t)(slash - rel);
        if (len == 0 || len >= sizeof(comp)) {
            close(cur);
            return -EINVAL;
        }
        memcpy(comp, rel, len);
        comp[len] = '\0';
        rc = fsu_open_dir_at(cur, comp, &next);
        close(cur);
        if (rc != 0) {
            if (rc == -ELOOP)
                *mode = S_IFLNK;
            return rc;
        }
        cur = next;
        rel = slash + 1;
    }
    *name = rel;
    *dirfd = cur;
    return 0;
}

/* The parse of the index open at fd (sb: its fstat), for its base, capped by the model: the one the
 * request carries when it is of this version (no read, no parse), else read and parsed here.  *p (a
 * reference: ix and the text it was parsed from, for the staged copy) on INTAKE_OK. */
static intake_status read_index(intake_req *r, int fd, const struct stat *sb, const char *name, index_parse **p)
{
    char base[ST_INDEX_BASE_MAX + 1];
    uint32_t i, n;
    int rc;

    *p = NULL;
    if (st_index_classify(name, strlen(name), base, &i, &n) != ST_NAME_INDEX) {
        dl_fail(&r->err, DL_E_INVALID_PATH, NULL, 0, "an index is named <base>" ST_INDEX_SUFFIX);
        return INTAKE_INVALID;
    }
    /* the cap follows the model: an index lists at most its floating tensors */
    size_t cap = st_index_cap_for(r->global);
    if ((uint64_t)sb->st_size > cap) {
        dl_fail(&r->err, DL_E_HEADER_TOO_LARGE, NULL, 0,
                "index of %" PRIu64 " bytes is over the %zu-byte cap for this model's %zu tensors",
                (uint64_t)sb->st_size, cap, r->global->ntensors);
        return INTAKE_INVALID;
    }
    /* a parse, or a refusal, of this very version decides; anything else is read again here (the
     * cap above is what the parse's own would have said: st_index_parse_capped checks only the size) */
    if (r->index != NULL && index_parse_is_version(r->index, sb) &&
        (r->index->ix != NULL || r->index->status == INDEX_REFUSED)) {
        *p = index_parse_ref(r->index);
    } else {
        if ((rc = index_parse_read(fd, sb, base, p)) != 0)
            return intake__io_fail(r, -rc, "out of memory for the index");
        r->index_parsed = (*p)->status != INDEX_UNREAD;
    }
    if ((*p)->status == INDEX_PARSED)
        return INTAKE_OK;
    /* JSON cut short (no closing brace yet), a file changing: an index still being written */
    index_parse_error(*p, &r->err);
    if ((*p)->incomplete)
        return INTAKE_INCOMPLETE;
    return (*p)->status == INDEX_UNREAD && (*p)->code == DL_E_IO ? INTAKE_IO : INTAKE_INVALID;
}

/* The names in dirfd's directory, for st_index_check_listing. */
static intake_status check_listing(intake_req *r, int dirfd, const st_index *ix)
{
    char **names = NULL;
    size_t n = 0, cap = 0;
    intake_status st = INTAKE_OK;
    struct dirent *de;
    int fd = dup(dirfd);
    DIR *d = fd >= 0 ? fdopendir(fd) : NULL;

    if (d == NULL) {
        if (fd >= 0)
            close(fd);
        return intake__io_fail(r, errno, "listing the set's directory");
    }
    rewinddir(d);
    while ((de = readdir(d)) != NULL) {
        if (n == cap) {
            char **more = realloc(names, (cap = cap ? 2 * cap : 64) * sizeof(*names));
            if (more == NULL) {
                st = intake__io_fail(r, ENOMEM, "out of memory");
                goto out;
            }
            names = more;
        }
        if ((names[n] = strdup(de->d_name)) == NULL) {
            st = intake__io_fail(r, ENOMEM, "out of memory");
            goto out;
        }
        n++;
    }
    if (st_index_check_listing(ix, (const char *const *)names, n, &r->err) != 0)
        st = INTAKE_INVALID;
out:
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
    closedir(d);
    return st;
}

/* Shard i's header against the index, before its data is copied: it holds exactly the tensors the
 * index lists for it (listed[i] of them).  Checked shard by shard, the copies of a set add up to
 * one delta at most, however many shards a hostile index lists and whatever they hold. */
static int check_shard_against_index(const st_index *ix, uint32_t i, const uint32_t *listed, const st_header *h,
                                     dl_error *err)
{
    char other[ST_INDEX_BASE_MAX + 40];

    for (size_t k = 0; k < h->ntensors; k++) {
        const st_tensor *t = &h->tensors[k];
        const st_index_entry *e = st_index_find(ix, t->name, t->name_len);
        if (e == NULL)
            return dl_fail(err, DL_E_KEY_MISMATCH, t->name, t->name_len, "holds a tensor the index does not list");
        if (e->shard == i)
            continue;
        st_index_shard_name(ix->base, e->shard, ix->nshards, other, sizeof(other));
        /* the shards before this one were found to hold what the index lists for them */
        return dl_fail(err, DL_E_KEY_MISMATCH, t->name, t->name_len,
                       e->shard < i ? "tensor is in two shards, %s and this one"
                                    : "the index lists the tensor in %s but it is in this one", other);
    }
    if (h->ntensors == listed[i])
        return 0;
    for (size_t k = 0; k < ix->nentries; k++) {
        const st_index_entry *e = &ix->entries[k];
        if (e->shard == i && st_header_find(h, e->name, e->name_len) == NULL)
            return dl_fail(err, DL_E_KEY_MISMATCH, e->name, e->name_len,
                           "the index lists the tensor in this shard but it does not hold it");
    }
    return dl_fail(err, DL_E_KEY_MISMATCH, NULL, 0, "does not hold what the index lists for it");
}

/* Shard i (name) of ix under dirfd: checked (header against the global and the index, finite
 * values) and copied to stage/name, fsynced.  *bytes receives its size. */
static intake_status take_shard(intake_req *r, int dirfd, const st_index *ix, uint32_t i, const uint32_t *listed,
                                const char *name, const char *stage, const st_tensor *const *global, size_t nglobal,
                                uint64_t room, uint64_t *bytes)
{
    struct stat before;
    unsigned char prefix[8];
    char *json = NULL, *dst_path = NULL;
    st_header *h = NULL;
    uint64_t n;
    int src = -1, dst = -1, rc;
    intake_status st;

    if ((rc = fsu_open_file_at(dirfd, name, &src, &before)) != 0) {
        st = intake__open_refusal(r, rc, before.st_mode);
        if (rc == -ENOENT)          /* the index came first: its shards are on their way */
            dl_fail(&r->err, DL_E_IO, NULL, 0, "missing: the index lists it but it is not there (yet)");
        goto out;
    }
    *bytes = (uint64_t)before.st_size;
    if (*bytes > room) {
        dl_fail(&r->err, DL_E_HEADER_TOO_LARGE, NULL, 0,
                "the set's shards hold more than the delta budget (the model's delta bytes plus one header cap)");
        st = INTAKE_INVALID;
        goto out;
    }
    if ((st = intake__read_header(r, src, *bytes, prefix, &json, &n, &h)) != INTAKE_OK)
        goto out;
    if (delta_check_shard_header(h, global, nglobal, &r->info.cz, &r->err) != 0 ||
        check_shard_against_index(ix, i, listed, h, &r->err) != 0) {
        st = INTAKE_INVALID;
        goto out;
    }
    if (asprintf(&dst_path, "%s/%s", stage, name) < 0) {
        dst_path = NULL;
        st = intake__io_fail(r, ENOMEM, "out of memory");
        goto out;
    }
    if ((dst = open(dst_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644)) < 0) {
        st = intake__io_fail(r, errno, "creating the staged shard");
        goto out;
    }
    st = intake__copy_file(r, src, &before, dst, prefix, json, n, h);
out:
    if (st != INTAKE_OK)
        name_shard(&r->err, name);
    if (dst >= 0)
        close(dst);
    if (src >= 0)
        close(src);
    free(dst_path);
    free(json);
    st_header_free(h);
    return st;
}

/* Empties and removes a staging directory (its entries are plain files we made). */
static void remove_stage(const char *stage)
{
    DIR *d = opendir(stage);
    struct dirent *de;

    if (d != NULL) {
        while ((de = readdir(d)) != NULL) {
            if (strcmp(de->d_name, ".") != 0 && strcmp(de->d_name, "..") != 0)
                unlinkat(dirfd(d), de->d_name, 0);
        }
        closedir(d);
    }
    rmdir(stage);
}

/* An open that failed: the set's fault unless it was ours (an I/O error, no memory). */
static intake_status open_failure(const dl_error *err)
{
    return err->code == DL_E_IO || err->code == DL_E_NO_MEMORY ? INTAKE_IO : INTAKE_INVALID;
}

intake_status intake_check_set_dir(const char *dir, st_index *ix, const st_tensor *const *global, size_t nglobal,
                                   const char *rel, delta_info *info, st_set **set, uint64_t *shard_bytes,
                                   dl_error *err)
{
    char *path = NULL;
    st_file **files;
    uint32_t opened = 0;
    uint64_t bytes = 0;

    *set = NULL;
    if ((files = calloc(ix->nshards ? ix->nshards : 1, sizeof(*files))) == NULL) {
        st_index_free(ix);
        dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        return INTAKE_IO;
    }
    for (; opened < ix->nshards; opened++) {
        char name[ST_INDEX_BASE_MAX + 40];
        st_index_shard_name(ix->base, opened, ix->nshards, name, sizeof(name));
        free(path);
        if (asprintf(&path, "%s/%s", dir, name) < 0) {
            path = NULL;
            dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            break;
        }
        if (st_open(path, &files[opened], err) != 0)
            break;
        bytes += files[opened]->file_size;
        if (st_file_lazy(files[opened], err) != 0) {
            st_close(files[opened]);
            break;
        }
    }
    free(path);
    path = NULL;
    if (opened == ix->nshards && asprintf(&path, "%s/%s" ST_INDEX_SUFFIX, dir, ix->base) < 0) {
        path = NULL;
        dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    if (path == NULL) {
        for (uint32_t i = 0; i < opened; i++)
            st_close(files[i]);
        free(files);
        st_index_free(ix);
        return open_failure(err);
    }
    int rc = st_set_assemble(path, ix, files, set, err);        /* owns ix and files from here */
    free(path);
    if (rc != 0)
        return open_failure(err);
    if (delta_check_set_header(*set, global, nglobal, rel, info, err) != 0)
        return INTAKE_INVALID;
    if (shard_bytes != NULL)
        *shard_bytes = bytes;
    return INTAKE_OK;
}

/* A cached set met again at restart: its files were checked when they entered the cache. */
static intake_status reopen_cached_set(intake_req *r, const st_tensor *const *global, size_t nglobal)
{
    st_set *set = NULL;
    intake_status st = INTAKE_OK;

    if (st_set_open(r->src_path, &set, &r->err) != 0)
        return INTAKE_INVALID;
    if (delta_check_set_header(set, global, nglobal, NULL, NULL, &r->err) != 0)
        st = INTAKE_INVALID;
    for (size_t i = 0; st == INTAKE_OK && i < set->nfiles; i++)
        r->size += set->files[i]->file_size;
    if (st == INTAKE_OK && (r->cache_path = strdup(r->src_path)) == NULL)
        st = intake__io_fail(r, ENOMEM, "out of memory");
    st_set_close(set);
    return st;
}

/* The shards' sizes together against the set's budget (intake_set_budget), before a byte is copied:
 * a set over it is refused whole, so it never takes room in the state root.  A missing shard is
 * left for take_shard to report. */
static intake_status check_set_budget(intake_req *r, int dirfd, const st_index *ix, uint64_t budget)
{
    uint64_t total = 0;

    for (uint32_t i = 0; i < ix->nshards; i++) {
        char shard[ST_INDEX_BASE_MAX + 40];
        struct stat sb;
        st_index_shard_name(ix->base, i, ix->nshards, shard, sizeof(shard));
        if (fstatat(dirfd, shard, &sb, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(sb.st_mode))
            continue;
        total += (uint64_t)sb.st_size;
        if (total > budget) {
            dl_fail(&r->err, DL_E_HEADER_TOO_LARGE, NULL, 0,
                    "the set's %u shards hold more than %" PRIu64 " bytes, the delta budget (the model's %" PRIu64
                    " delta bytes plus one header cap)", ix->nshards, budget, intake_delta_bytes(r->global));
            return INTAKE_INVALID;
        }
    }
    return INTAKE_OK;
}

intake_status intake__set(intake_req *r)
{
    uint64_t budget = intake_set_budget(intake_delta_bytes(r->global), intake__max_header(r)), taken = 0;
    struct stat before, after;
    const char *name = NULL;
    char *stage = NULL;
    size_t nglobal = r->global->ntensors;
    const st_tensor **global = NULL;
    uint32_t *listed = NULL;
    index_parse *parse = NULL;
    const st_index *ix;
    st_index *owned;
    st_set *set = NULL;
    mode_t mode;
    int dirfd = -1, fd = -1, staged = 0, rc;
    intake_status st;

    if ((rc = open_set_dir(r, &dirfd, &name, &mode)) != 0 || (rc = fsu_open_file_at(dirfd, name, &fd, &before)) != 0) {
        st = intake__open_refusal(r, rc, dirfd < 0 ? mode : before.st_mode);
        goto out;
    }
    r->size = (uint64_t)before.st_size;
    r->mtime_ns = intake__mtime_ns(&before);
    r->ino = (uint64_t)before.st_ino;
    if ((st = read_index(r, fd, &before, name, &parse)) != INTAKE_OK)
        goto out;
    ix = parse->ix;
    /* the index alone decides what the set is for: a stale set costs only its index */
    if (delta_check_meta(ix->meta, ix->nmeta, r->rel_path, &r->info, &r->err) != 0) {
        st = INTAKE_INVALID;
        goto out;
    }
    if (INTAKE_STALE_BASE(r, r->info.base_outer_step) || r->info.base_outer_step > r->step) {
        st = r->info.base_outer_step < r->step ? INTAKE_STALE : INTAKE_FUTURE;
        goto out;
    }
    if (delta_header_by_name(r->global, &global, &r->err) != 0) {
        st = intake__io_fail(r, ENOMEM, "out of memory");
        goto out;
    }
    if (r->in_cache) {
        r->norm_unknown = 1;    /* not read again at a restart: the set's norm is not known */
        st = reopen_cached_set(r, global, nglobal);
        goto out;
    }
    if (intake__cached_in_any_layout(r->state_dir, &r->info)) {
        st = INTAKE_DUPLICATE;
        goto out;
    }
    if ((st = check_listing(r, dirfd, ix)) != INTAKE_OK)
        goto out;
    if ((stage = store_path_incoming(r->state_dir)) == NULL) {
        st = intake__io_fail(r, ENOMEM, "out of memory");
        goto out;
    }
    if (fsu_mkdirs(stage, &r->err) != 0) {
        st = INTAKE_IO;
        goto out;
    }
    free(stage);
    if ((stage = store_path_incoming_file(r->state_dir, "intake-XXXXXX")) == NULL) {
        st = intake__io_fail(r, ENOMEM, "out of memory");
        goto out;
    }
    if (mkdtemp(stage) == NULL) {
        st = intake__io_fail(r, errno, "creating the staging directory");
        goto out;
    }
    staged = 1;
    if ((listed = calloc(ix->nshards, sizeof(*listed))) == NULL) {
        st = intake__io_fail(r, ENOMEM, "out of memory");
        goto out;
    }
    for (size_t k = 0; k < ix->nentries; k++)
        listed[ix->entries[k].shard]++;
    if ((st = check_set_budget(r, dirfd, ix, budget)) != INTAKE_OK)
        goto out;
    for (uint32_t i = 0; i < ix->nshards; i++) {
        char shard[ST_INDEX_BASE_MAX + 40];
        uint64_t bytes = 0;
        st_index_shard_name(ix->base, i, ix->nshards, shard, sizeof(shard));
        /* the room left is checked again as each shard is opened: one may have grown since */
        if ((st = take_shard(r, dirfd, ix, i, listed, shard, stage, global, nglobal, budget - taken, &bytes)) !=
            INTAKE_OK)
            goto out;
        r->size += bytes;
        taken += bytes;
    }
    if (fstat(fd, &after) != 0 || after.st_size != before.st_size || intake__mtime_ns(&after) != r->mtime_ns) {
        dl_fail(&r->err, DL_E_IO, NULL, 0, "the index changed while its set was read");
        st = INTAKE_INCOMPLETE;
        goto out;
    }
    {
        char *staged_index = NULL;
        if (asprintf(&staged_index, "%s/%s" ST_INDEX_SUFFIX, stage, ix->base) < 0) {
            st = intake__io_fail(r, ENOMEM, "out of memory");
            goto out;
        }
        rc = fsu_write_atomic(staged_index, parse->text, parse->len, &r->err);
        free(staged_index);
        if (rc != 0) {
            st = INTAKE_IO;
            goto out;
        }
    }
    /* the set takes an index of its own: the parse may be shared (the transport's memo) */
    if ((owned = st_index_clone(ix)) == NULL) {
        st = intake__io_fail(r, ENOMEM, "out of memory");
        goto out;
    }
    st = intake_check_set_dir(stage, owned, global, nglobal, r->rel_path, NULL, &set, NULL, &r->err);
    if (st == INTAKE_OK)
        st = intake_link_set_into_cache(r->state_dir, &r->info, stage, set->index, &r->cache_path, &r->err);
out:
    st_set_close(set);
    if (staged)
        remove_stage(stage);    /* linked into the cache or abandoned: the staged names go */
    free(stage);
    index_parse_release(parse);
    free(listed);
    free(global);
    if (fd >= 0)
        close(fd);
    if (dirfd >= 0)
        close(dirfd);
    return st;
}
