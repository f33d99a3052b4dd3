#include "intake.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checksum.h"
#include "fsutil.h"
#include "mapread.h"
#include "st_index.h"

#define COPY_CHUNK (4u << 20)
/* A file that is only checked (linked, not copied) is read in place, a window of this many bytes at a
 * time (whole 2 MiB units of the file): 1 GiB checked in 0.16 s here against 0.27-0.30 s with pread into
 * a buffer, whose copy out of the page cache cost as much as the check.  Mapped pages count in RSS while
 * mapped: one window per intake in flight. */
#define CHECK_WINDOW (8u << 20)

const char *intake_status_name(intake_status s)
{
    switch (s) {
    case INTAKE_OK: return "ok";
    case INTAKE_STALE: return "stale";
    case INTAKE_FUTURE: return "future";
    case INTAKE_DUPLICATE: return "duplicate";
    case INTAKE_INCOMPLETE: return "incomplete";
    case INTAKE_INVALID: return "invalid";
    case INTAKE_IO: return "io_error";
    }
    return "?";
}

char *intake_cache_path(const char *state_dir, const delta_info *info)
{
    char *p = NULL;
    if (asprintf(&p, "%s/cache/deltas/s%" PRIu64 "/%s/delta_%" PRIu64 ".safetensors", state_dir,
                 info->base_outer_step, info->node_id, info->local_step) < 0)
        return NULL;
    return p;
}

void intake_req_free(intake_req *r)
{
    free(r->src_path);
    free(r->rel_path);
    free(r->hub_root);
    free(r->state_dir);
    free(r->cache_path);
    index_parse_release(r->index);
    free(r);
}

static int64_t mtime_ns(const struct stat *sb)
{
    return (int64_t)sb->st_mtim.tv_sec * 1000000000 + sb->st_mtim.tv_nsec;
}

static intake_status io_fail(intake_req *r, int e, const char *what)
{
    dl_fail_errno(&r->err, e, "%s", what);
    return INTAKE_IO;
}

/* The model's index of delta tensor t (delta_check_header matched every key by name): the tensor the
 * checksum's terms are keyed by (checksum.h). */
static uint32_t model_index(const intake_req *r, const st_tensor *t)
{
    const st_tensor *g = st_header_find(r->global, t->name, t->name_len);
    return g != NULL ? (uint32_t)(g - r->global->tensors) : UINT32_MAX;
}

/* Streams the data section from src to dst (both at data_start) tensor by tensor, checking finite
 * values; dst < 0 only checks (a file that is linked, not copied), and then adds the data's checksum to
 * r->ident (a linked file stays its writer's: the pass verifies what was checked).  Returns INTAKE_OK or
 * the failure. */
static intake_status copy_checked(intake_req *r, int src, int dst, const st_header *h, uint64_t data_start)
{
    unsigned char *buf = malloc(COPY_CHUNK);
    intake_status st = INTAKE_OK;
    uint64_t sum = 0;

    if (buf == NULL)
        return io_fail(r, ENOMEM, "out of memory for the copy buffer");
    for (size_t i = 0; i < h->ntensors && st == INTAKE_OK; i++) {
        const st_tensor *t = &h->tensors[i];
        size_t esize = st_dtype_bits(t->dtype) / 8;       /* deltas are F32/F16/BF16/C64: whole bytes */
        uint64_t per = COPY_CHUNK / esize;                /* a multiple of CK_BLOCK_ELEMS */
        uint32_t mt = model_index(r, t);
        for (uint64_t e = 0; e < t->nelem; e += per) {
            size_t n = (size_t)(t->nelem - e < per ? t->nelem - e : per);
            uint64_t off = data_start + t->begin + e * esize;
            int rc = fsu_pread_all(src, buf, n * esize, off);
            if (rc == -ENODATA) {
                st = INTAKE_INCOMPLETE;         /* it shrank: being rewritten */
                dl_fail(&r->err, DL_E_METADATA_INCOMPLETE_BUFFER, NULL, 0, "file shrank while being read");
                break;
            }
            if (rc != 0) {
                st = io_fail(r, -rc, "reading the delta");
                break;
            }
            int64_t bad = delta_find_non_finite(t->dtype, buf, n);
            if (bad >= 0) {
                dl_fail(&r->err, DL_E_NON_FINITE, t->name, t->name_len,
                        "delta tensor holds a non-finite value (NaN or Inf) at element %" PRIu64, e + (uint64_t)bad);
                st = INTAKE_INVALID;
                break;
            }
            if (dst < 0 && r->ck != NULL)
                sum += ck_blocks(r->ck, mt, t->dtype, e, buf, n, esize);
            if (dst >= 0 && (rc = fsu_pwrite_all(dst, buf, n * esize, off)) != 0) {
                st = io_fail(r, -rc, "writing the cache copy");
                break;
            }
        }
    }
    free(buf);
    if (st == INTAKE_OK && dst < 0 && r->ck != NULL) {
        r->ident.sum = sum;
        r->ident.has_sum = 1;
    }
    return st;
}

/* The node's cache directory, created if needed, opened and locked (flock): every link into it
 * runs under this lock, so the existence checks of both layouts and the links that follow are one
 * step for the uploads, the hub intakes and a set's several links alike.  Returns the descriptor
 * (closing it releases the lock) or -1 with err set. */
static int lock_node_dir(const char *dir, dl_error *err)
{
    int fd;

    if (fsu_mkdirs(dir, err) != 0)
        return -1;
    if ((fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0) {
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
    return fd;
}

/* Whether this node's delta of this local step is cached in either layout (the lock is held). */
static int cached_in_any_layout(const char *state_dir, const delta_info *info)
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
    if (cached_in_any_layout(state_dir, info)) {    /* a set of the same step counts too */
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
    char *p = NULL;
    if (asprintf(&p, "%s/cache/deltas/s%" PRIu64 "/%s/delta_%" PRIu64 ST_INDEX_SUFFIX, state_dir,
                 info->base_outer_step, info->node_id, info->local_step) < 0)
        return NULL;
    return p;
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
    if (cached_in_any_layout(state_dir, info)) {
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

static uint64_t max_header(const intake_req *r)
{
    return r->max_header != 0 && r->max_header < ST_MAX_HEADER_SIZE ? r->max_header : ST_MAX_HEADER_SIZE;
}

/* Opens the source as a regular file, never blocking on a FIFO; a delta of the shared tree only
 * through directories of that tree (no link at any level).  0 or a negative errno; on a refused
 * type sb->st_mode says what was there. */
uint64_t intake_delta_bytes(const st_header *global)
{
    uint64_t n = 0;
    for (size_t i = 0; i < global->ntensors; i++) {
        const st_tensor *t = &global->tensors[i];
        if (st_dtype_is_floating(t->dtype))
            n += t->nelem * (t->dtype == ST_C64 ? 8 : 4);
    }
    return n;
}

uint64_t intake_set_budget(uint64_t delta_bytes, uint64_t header_cap)
{
    uint64_t b;
    if (__builtin_add_overflow(delta_bytes, 8 + header_cap, &b))
        return UINT64_MAX;
    return b;
}

static int open_source(const intake_req *r, int *fd, struct stat *sb)
{
    int rootfd, rc;

    *fd = -1;
    memset(sb, 0, sizeof(*sb));
    if (r->hub_root != NULL && r->rel_path != NULL) {
        if ((rootfd = open(r->hub_root, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0)
            return -errno;
        rc = fsu_open_path_at(rootfd, r->rel_path, fd, sb);
        close(rootfd);
        return rc;
    }
    /* our own files (a download, the cache): the same checks cost nothing */
    if ((*fd = open(r->src_path, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC)) < 0) {
        rc = -errno;
        if (rc == -ELOOP)
            sb->st_mode = S_IFLNK;
        return rc;
    }
    rc = fstat(*fd, sb) != 0 ? -errno : S_ISREG(sb->st_mode) ? 0 : -EINVAL;
    if (rc != 0) {
        close(*fd);
        *fd = -1;
        return rc;
    }
    return 0;
}

/* The refusal for a source that open_source or fsu_open_file_at could not open (rc < 0); mode is
 * what was found there. */
static intake_status open_refusal(intake_req *r, int rc, mode_t mode)
{
    if (rc == -ENOENT) {
        dl_fail(&r->err, DL_E_IO, NULL, 0, "the file disappeared");
        return INTAKE_INCOMPLETE;
    }
    if (rc == -EAGAIN) {
        dl_fail(&r->err, DL_E_IO, NULL, 0, "the file is busy (leased by its writer)");
        return INTAKE_INCOMPLETE;
    }
    if (rc == -ELOOP || rc == -EISDIR || rc == -ENOTDIR || rc == -EINVAL) {
        /* never read: a link may lead out of the tree, a FIFO would block the reader */
        dl_fail(&r->err, DL_E_IO, NULL, 0, "%s: only regular files reached without symbolic links are read",
                rc == -ELOOP     ? "a symbolic link (the file or a directory above it)"
                : rc == -ENOTDIR ? "a directory on its path is not a directory"
                                 : fsu_kind_name(mode));
        return INTAKE_INVALID;
    }
    return io_fail(r, -rc, "opening the delta");
}

/* A safetensors file's header, read from src (size bytes): prefix, the JSON (*json, *n) and the
 * parsed header, checked to describe exactly size bytes.  INTAKE_OK or the refusal. */
static intake_status read_header(intake_req *r, int src, uint64_t size, unsigned char prefix[8], char **json,
                                 uint64_t *n, st_header **h)
{
    uint64_t want;

    *json = NULL;
    *h = NULL;
    if (size < 8 || fsu_pread_all(src, prefix, 8, 0) != 0) {
        dl_fail(&r->err, DL_E_HEADER_TOO_SMALL, NULL, 0, "file too small: %" PRIu64 " bytes", size);
        return INTAKE_INCOMPLETE;
    }
    *n = 0;
    for (int i = 7; i >= 0; i--)
        *n = (*n << 8) | prefix[i];
    if (*n > ST_MAX_HEADER_SIZE) {
        st_prefix_refusal(&r->err, DL_E_HEADER_TOO_LARGE, prefix, *n, size);  /* not a length: text, a ZIP ... */
        return INTAKE_INVALID;
    }
    if (*n > max_header(r)) {
        dl_fail(&r->err, DL_E_HEADER_TOO_LARGE, NULL, 0, "header too large: %" PRIu64 " bytes, the cap is %" PRIu64
                " (max_delta_header_mib)", *n, max_header(r));
        return INTAKE_INVALID;
    }
    if (8 + *n > size) {
        dl_fail(&r->err, DL_E_INVALID_HEADER_LENGTH, NULL, 0, "header of %" PRIu64 " bytes not complete yet", *n);
        return INTAKE_INCOMPLETE;
    }
    *json = malloc(*n ? *n : 1);
    if (*json == NULL || fsu_pread_all(src, *json, *n, 8) != 0)
        return io_fail(r, *json ? EIO : ENOMEM, "reading the header");
    if (st_header_parse_unsized(*json, *n, h, &r->err) != 0)
        return INTAKE_INVALID;
    if (st_header_file_len(*h, &want) != 0 || want != size) {
        dl_fail(&r->err, DL_E_METADATA_INCOMPLETE_BUFFER, NULL, 0,
                "incomplete metadata, file not fully covered: the header describes %" PRIu64
                " bytes, the file has %" PRIu64, want, size);
        /* shorter: still being written; longer: malformed */
        return want > size ? INTAKE_INCOMPLETE : INTAKE_INVALID;
    }
    return INTAKE_OK;
}

/* Copies a file whose header was read (before: its fstat then) to dst with the finite check, then
 * checks that it did not change meanwhile and fsyncs the copy. */
static intake_status copy_file(intake_req *r, int src, const struct stat *before, int dst,
                               const unsigned char prefix[8], const char *json, uint64_t n, const st_header *h)
{
    struct stat after;
    intake_status st;
    int rc;

    if ((rc = posix_fallocate(dst, 0, before->st_size)) != 0 && rc != EOPNOTSUPP && rc != EINVAL)
        return io_fail(r, rc, "reserving space for the cache copy");
    if ((rc = fsu_pwrite_all(dst, prefix, 8, 0)) != 0 || (rc = fsu_pwrite_all(dst, json, n, 8)) != 0)
        return io_fail(r, -rc, "writing the cache copy");
    if ((st = copy_checked(r, src, dst, h, 8 + n)) != INTAKE_OK)
        return st;
    if (fstat(src, &after) != 0 || after.st_size != before->st_size || mtime_ns(&after) != mtime_ns(before)) {
        dl_fail(&r->err, DL_E_IO, NULL, 0, "the file changed while it was read");
        return INTAKE_INCOMPLETE;
    }
    if (fsync(dst) != 0)
        return io_fail(r, errno, "fsync of the cache copy");
    return INTAKE_OK;
}

typedef struct window_check {
    st_dtype dtype;
    const void *data;
    size_t nelem;
    int64_t bad;                /* the first non-finite element, or -1 */
    /* the window's checksum terms: its blocks of tensor `tensor` from element `first` on */
    const ck_key *ck;
    uint32_t tensor;
    st_dtype block_dtype;       /* the tensor's own dtype (C64 is checked as F32 lanes) */
    uint64_t first, elems;
    size_t esize;
    uint64_t sum;
} window_check;

static int window_check_call(void *arg)
{
    window_check *w = arg;
    w->bad = delta_find_non_finite(w->dtype, w->data, w->nelem);
    if (w->bad < 0 && w->ck != NULL)
        w->sum = ck_blocks(w->ck, w->tensor, w->block_dtype, w->first, w->data, w->elems, w->esize);
    return 0;
}

/* The finite check read in place, of the checksum blocks (CK_BLOCK_ELEMS elements of a tensor) that
 * begin within file bytes [lo, hi) (lo and hi on CHECK_WINDOW boundaries, or the data's ends): a part of
 * a file's check.  A window ends on the first block boundary at or after a CHECK_WINDOW boundary, so that
 * it maps whole units and holds whole blocks.  Tensors in header order, each part stopping at its first
 * finding, so that the finding of the first tensor in header order wins when the parts are merged (as a
 * check in one part would report it). */
typedef struct check_part {
    int src;
    uint64_t size;
    const st_header *h;
    const intake_req *r;
    uint64_t data_start, lo, hi;
    int unmappable;             /* a window could not be mapped: check the whole file with pread */
    int shrank;                 /* SIGBUS: the file was cut short under the mapping */
    size_t bad_tensor;          /* the tensor of the first non-finite value, h->ntensors when none */
    uint64_t bad_elem;          /* its element */
    uint64_t sum;               /* the checksum terms of the part's blocks */
} check_part;

/* The blocks of tensor ti that begin within [c->lo, c->hi): 1 when the part found something (or must
 * fall back). */
static int check_tensor_part(check_part *c, size_t ti)
{
    const st_tensor *t = &c->h->tensors[ti];
    /* C64 is checked as its F32 lanes */
    const st_dtype dt = t->dtype == ST_C64 ? ST_F32 : t->dtype;
    const size_t esize = st_dtype_bits(t->dtype) / 8, lane = st_dtype_bits(dt) / 8;
    const uint64_t first = c->data_start + t->begin, block = (uint64_t)CK_BLOCK_ELEMS * esize;
    const uint64_t last = first + t->nelem * esize;
    /* the first block that begins at or after lo */
    uint64_t off = c->lo <= first ? first : first + (c->lo - first + block - 1) / block * block;

    while (off < last && off < c->hi) {
        /* to the first block boundary at or after the next CHECK_WINDOW boundary */
        uint64_t end = off - off % CHECK_WINDOW + CHECK_WINDOW;
        end = first + (end - first + block - 1) / block * block;
        if (end > last)
            end = last;
        void *base;
        size_t maplen;
        window_check w = {
            .dtype = dt,
            .data = mapread_map(c->src, c->size, off, end - off, 1, &base, &maplen),
            .nelem = (end - off) / lane,
            .bad = -1,
            .ck = c->r->ck,
            .tensor = model_index(c->r, t),
            .block_dtype = t->dtype,
            .first = (off - first) / esize,
            .elems = (end - off) / esize,
            .esize = esize,
        };
        if (w.data == NULL)
            return c->unmappable = 1;
        int rc = mapread_guarded(window_check_call, &w);
        mapread_unmap(base, maplen);
        if (rc == MAPREAD_BUS)
            return c->shrank = 1;
        if (w.bad >= 0) {
            c->bad_tensor = ti;
            c->bad_elem = ((off - first) / lane + (uint64_t)w.bad) * lane / esize;
            return 1;
        }
        c->sum += w.sum;
        off = end;
    }
    return 0;
}

static void check_part_run(check_part *c)
{
    c->bad_tensor = c->h->ntensors;
    for (size_t i = 0; i < c->h->ntensors; i++)
        if (check_tensor_part(c, i))
            return;
}

static void *check_part_thread(void *arg)
{
    check_part_run(arg);
    return NULL;
}

/* Checks in flight in this process: a check that runs alone takes a second thread (below). */
static _Atomic int checks_running;
uint64_t intake_split_min = (uint64_t)64 << 20;

/* The two parts' findings as one status: a part that could not map means the whole file is read with
 * pread; else the file cut short, else the first non-finite value in header order; none: the checksum
 * is the parts' sum. */
static intake_status merge_parts(intake_req *r, int src, const check_part *parts, size_t n)
{
    const check_part *bad = NULL;
    uint64_t sum = 0;

    for (size_t k = 0; k < n; k++)
        if (parts[k].unmappable)
            return copy_checked(r, src, -1, parts[0].h, parts[0].data_start);
    for (size_t k = 0; k < n; k++) {
        if (parts[k].shrank) {
            dl_fail(&r->err, DL_E_METADATA_INCOMPLETE_BUFFER, NULL, 0, "file shrank while being read");
            return INTAKE_INCOMPLETE;
        }
        if (parts[k].bad_tensor < parts[k].h->ntensors &&
            (bad == NULL || parts[k].bad_tensor < bad->bad_tensor ||
             (parts[k].bad_tensor == bad->bad_tensor && parts[k].bad_elem < bad->bad_elem)))
            bad = &parts[k];
        sum += parts[k].sum;
    }
    if (bad == NULL) {
        r->ident.sum = sum;
        r->ident.has_sum = r->ck != NULL;
        return INTAKE_OK;
    }
    const st_tensor *t = &bad->h->tensors[bad->bad_tensor];
    dl_fail(&r->err, DL_E_NON_FINITE, t->name, t->name_len,
            "delta tensor holds a non-finite value (NaN or Inf) at element %" PRIu64, bad->bad_elem);
    return INTAKE_INVALID;
}

/* The finite check of every tensor, with the data's checksum, read in place where the data is aligned
 * for its dtype and can be mapped, else with pread.  Large data checked alone is split in two halves on a
 * window boundary, one checked by a thread of its own. */
static intake_status check_values(intake_req *r, int src, uint64_t size, const st_header *h, uint64_t data_start)
{
    check_part parts[2] = {{.src = src, .size = size, .h = h, .r = r, .data_start = data_start, .lo = data_start,
                            .hi = size}};
    size_t nparts = 1;
    pthread_t helper;
    int helped = 0;

    for (size_t i = 0; i < h->ntensors; i++) {
        const st_tensor *t = &h->tensors[i];
        size_t esize = st_dtype_bits(t->dtype) / 8;
        /* element-aligned (a header length the reference allows may leave it odd) */
        if ((data_start + t->begin) % (esize > 4 ? 4 : esize) != 0)
            return copy_checked(r, src, -1, h, data_start);
    }
    int alone = atomic_fetch_add(&checks_running, 1) == 0;
    if (alone && size - data_start >= intake_split_min) {
        uint64_t mid = data_start + (size - data_start) / 2;
        mid -= mid % CHECK_WINDOW;
        parts[1] = parts[0];
        parts[0].hi = parts[1].lo = mid;
        nparts = 2;
        helped = pthread_create(&helper, NULL, check_part_thread, &parts[1]) == 0;
    }
    check_part_run(&parts[0]);
    if (helped)
        pthread_join(helper, NULL);
    else if (nparts == 2)
        check_part_run(&parts[1]);      /* no thread: the second half after the first */
    atomic_fetch_sub(&checks_running, 1);
    return merge_parts(r, src, parts, nparts);
}

/* Reads a whole file whose header was read (before: its fstat then) with the finite check, and checks
 * that it did not change meanwhile. */
static intake_status check_file(intake_req *r, int src, const struct stat *before, uint64_t n, const st_header *h)
{
    struct stat after;
    intake_status st = check_values(r, src, (uint64_t)before->st_size, h, 8 + n);

    if (st != INTAKE_OK)
        return st;
    if (fstat(src, &after) != 0 || after.st_size != before->st_size || mtime_ns(&after) != mtime_ns(before)) {
        dl_fail(&r->err, DL_E_IO, NULL, 0, "the file changed while it was read");
        return INTAKE_INCOMPLETE;
    }
    return INTAKE_OK;
}

/* Zero-copy: validates src by reading it, then hard-links that very inode (through its descriptor,
 * so a rename in the tree meanwhile cannot swap it) into the cache.  Returns INTAKE_OK (linked),
 * a refusal, or INTAKE_IO with r->link_errno set when a link is not possible here (the caller copies). */
static intake_status link_file(intake_req *r, int src, const struct stat *before, uint64_t n, const st_header *h)
{
    char *tmp = NULL;
    intake_status st;
    int rc;

    if ((st = check_file(r, src, before, n, h)) != INTAKE_OK)
        return st;
    if (asprintf(&tmp, "%s/cache/incoming/.link-%d-%" PRIu64, r->state_dir, (int)getpid(), (uint64_t)before->st_ino) <
        0)
        return io_fail(r, ENOMEM, "out of memory");
    (void)unlink(tmp);          /* a leftover of a crash under the same pid and inode */
    if ((r->link_errno = fsu_link_fd(src, AT_FDCWD, tmp)) != 0) {
        free(tmp);
        return io_fail(r, r->link_errno, "linking the delta into the cache");
    }
    st = intake_link_into_cache(r->state_dir, &r->info, tmp, &r->cache_path, &r->err);
    unlink(tmp);
    free(tmp);
    if (st != INTAKE_OK)
        return st;
    /* Written to between the read above and the link: that version was not validated.  The version
     * kept is the one after our links (which moved its ctime): from here any write moves ctime again,
     * and one that put mtime back in between is caught by the checksum, which the pass verifies. */
    struct stat now;
    fsu_ident read_version;
    fsu_ident_of(before, &read_version);
    rc = lstat(r->cache_path, &now) != 0 ? -errno : 0;
    if (rc == 0)
        fsu_ident_of(&now, &r->ident);
    if (rc != 0 || !fsu_ident_same_content(&read_version, &r->ident)) {
        unlink(r->cache_path);
        free(r->cache_path);
        r->cache_path = NULL;
        if (rc < 0)
            return io_fail(r, -rc, "checking the linked delta");
        dl_fail(&r->err, DL_E_IO, NULL, 0, "the file changed while it was taken in");
        return INTAKE_INCOMPLETE;
    }
    r->linked = 1;
    return INTAKE_OK;
}

/* Restart: a cache entry that is still linked to a file others write may have changed while we were
 * down: read it in full again and guard it. */
static intake_status recheck_linked(intake_req *r, int src, const struct stat *before, uint64_t n,
                                    const st_header *h)
{
    intake_status st = check_file(r, src, before, n, h);

    if (st == INTAKE_INCOMPLETE) {
        dl_fail(&r->err, DL_E_IO, NULL, 0, "a cached delta linked to the shared tree changed while it was read");
        return INTAKE_INVALID;
    }
    if (st != INTAKE_OK)
        return st;
    fsu_ident_of(before, &r->ident);
    r->linked = 1;
    return INTAKE_OK;
}

static intake_status intake_set(intake_req *r);

static intake_status intake(intake_req *r)
{
    struct stat before;
    unsigned char prefix[8];
    char *json = NULL, *tmp = NULL;
    st_header *h = NULL;
    uint64_t n;
    int src = -1, dst = -1, rc;
    intake_status st;

    if ((rc = open_source(r, &src, &before)) != 0) {
        st = open_refusal(r, rc, before.st_mode);
        goto out;
    }
    r->size = (uint64_t)before.st_size;
    r->mtime_ns = mtime_ns(&before);
    r->ino = (uint64_t)before.st_ino;
    if ((st = read_header(r, src, r->size, prefix, &json, &n, &h)) != INTAKE_OK)
        goto out;
    if (delta_check_header(h, r->global, r->rel_path, &r->info, &r->err) != 0) {
        st = INTAKE_INVALID;
        goto out;
    }
    if (r->info.base_outer_step < r->step) {
        st = INTAKE_STALE;
        goto out;
    }
    if (r->info.base_outer_step > r->step) {
        st = INTAKE_FUTURE;
        goto out;
    }
    if (r->in_cache) {          /* validated when it entered the cache: the header check suffices */
        if (before.st_nlink > 1 && (st = recheck_linked(r, src, &before, n, h)) != INTAKE_OK)
            goto out;
        r->cache_path = strdup(r->src_path);
        st = r->cache_path ? INTAKE_OK : io_fail(r, ENOMEM, "out of memory");
        goto out;
    }
    if (cached_in_any_layout(r->state_dir, &r->info)) {
        st = INTAKE_DUPLICATE;
        goto out;
    }
    if (r->hub_root != NULL && !r->no_link) {
        st = link_file(r, src, &before, n, h);
        if (st != INTAKE_IO || r->link_errno == 0)
            goto out;
        /* no link here (another filesystem, links refused): copy, the data is read once more */
        dl_error_clear(&r->err);
    }
    if (asprintf(&tmp, "%s/cache/incoming/delta", r->state_dir) < 0) {
        tmp = NULL;
        st = io_fail(r, ENOMEM, "out of memory");
        goto out;
    }
    {
        char *t = NULL;
        rc = fsu_tmp_create(tmp, &t, &dst, &r->err);
        free(tmp);
        tmp = t;
        if (rc != 0) {
            st = INTAKE_IO;
            goto out;
        }
    }
    if ((st = copy_file(r, src, &before, dst, prefix, json, n, h)) != INTAKE_OK)
        goto out;
    st = intake_link_into_cache(r->state_dir, &r->info, tmp, &r->cache_path, &r->err);
out:
    if (dst >= 0)
        close(dst);
    if (tmp != NULL) {
        unlink(tmp);            /* linked into the cache or abandoned: the temporary name goes */
        free(tmp);
    }
    if (src >= 0)
        close(src);
    free(json);
    st_header_free(h);
    return st;
}

/* ---- a sharded delta --------------------------------------------------------------------------- */

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
            return io_fail(r, -rc, "out of memory for the index");
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
        return io_fail(r, errno, "listing the set's directory");
    }
    rewinddir(d);
    while ((de = readdir(d)) != NULL) {
        if (n == cap) {
            char **more = realloc(names, (cap = cap ? 2 * cap : 64) * sizeof(*names));
            if (more == NULL) {
                st = io_fail(r, ENOMEM, "out of memory");
                goto out;
            }
            names = more;
        }
        if ((names[n] = strdup(de->d_name)) == NULL) {
            st = io_fail(r, ENOMEM, "out of memory");
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
        st = open_refusal(r, rc, before.st_mode);
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
    if ((st = read_header(r, src, *bytes, prefix, &json, &n, &h)) != INTAKE_OK)
        goto out;
    if (delta_check_shard_header(h, global, nglobal, &r->err) != 0 ||
        check_shard_against_index(ix, i, listed, h, &r->err) != 0) {
        st = INTAKE_INVALID;
        goto out;
    }
    if (asprintf(&dst_path, "%s/%s", stage, name) < 0) {
        dst_path = NULL;
        st = io_fail(r, ENOMEM, "out of memory");
        goto out;
    }
    if ((dst = open(dst_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644)) < 0) {
        st = io_fail(r, errno, "creating the staged shard");
        goto out;
    }
    st = copy_file(r, src, &before, dst, prefix, json, n, h);
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
        st = io_fail(r, ENOMEM, "out of memory");
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

static intake_status intake_set(intake_req *r)
{
    uint64_t budget = intake_set_budget(intake_delta_bytes(r->global), max_header(r)), taken = 0;
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
        st = open_refusal(r, rc, dirfd < 0 ? mode : before.st_mode);
        goto out;
    }
    r->size = (uint64_t)before.st_size;
    r->mtime_ns = mtime_ns(&before);
    r->ino = (uint64_t)before.st_ino;
    if ((st = read_index(r, fd, &before, name, &parse)) != INTAKE_OK)
        goto out;
    ix = parse->ix;
    /* the index alone decides what the set is for: a stale set costs only its index */
    if (delta_check_meta(ix->meta, ix->nmeta, r->rel_path, &r->info, &r->err) != 0) {
        st = INTAKE_INVALID;
        goto out;
    }
    if (r->info.base_outer_step != r->step) {
        st = r->info.base_outer_step < r->step ? INTAKE_STALE : INTAKE_FUTURE;
        goto out;
    }
    if (delta_header_by_name(r->global, &global, &r->err) != 0) {
        st = io_fail(r, ENOMEM, "out of memory");
        goto out;
    }
    if (r->in_cache) {
        st = reopen_cached_set(r, global, nglobal);
        goto out;
    }
    if (cached_in_any_layout(r->state_dir, &r->info)) {
        st = INTAKE_DUPLICATE;
        goto out;
    }
    if ((st = check_listing(r, dirfd, ix)) != INTAKE_OK)
        goto out;
    if (asprintf(&stage, "%s/cache/incoming", r->state_dir) < 0) {
        stage = NULL;
        st = io_fail(r, ENOMEM, "out of memory");
        goto out;
    }
    if (fsu_mkdirs(stage, &r->err) != 0) {
        st = INTAKE_IO;
        goto out;
    }
    free(stage);
    if (asprintf(&stage, "%s/cache/incoming/intake-XXXXXX", r->state_dir) < 0) {
        stage = NULL;
        st = io_fail(r, ENOMEM, "out of memory");
        goto out;
    }
    if (mkdtemp(stage) == NULL) {
        st = io_fail(r, errno, "creating the staging directory");
        goto out;
    }
    staged = 1;
    if ((listed = calloc(ix->nshards, sizeof(*listed))) == NULL) {
        st = io_fail(r, ENOMEM, "out of memory");
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
    if (fstat(fd, &after) != 0 || after.st_size != before.st_size || mtime_ns(&after) != r->mtime_ns) {
        dl_fail(&r->err, DL_E_IO, NULL, 0, "the index changed while its set was read");
        st = INTAKE_INCOMPLETE;
        goto out;
    }
    {
        char *staged_index = NULL;
        if (asprintf(&staged_index, "%s/%s" ST_INDEX_SUFFIX, stage, ix->base) < 0) {
            st = io_fail(r, ENOMEM, "out of memory");
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
        st = io_fail(r, ENOMEM, "out of memory");
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

void intake_run(intake_req *r)
{
    dl_error_clear(&r->err);
    r->status = st_index_is_index_path(r->src_path) ? intake_set(r) : intake(r);
}
