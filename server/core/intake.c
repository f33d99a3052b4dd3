/* Intake of a single delta file (intake.h): opened without links or FIFOs, its header checked first
 * (a stale or wrong delta costs only its header), then its data checked for finite values on the
 * way to a temporary copy, or read in place (mapped, in two halves at once when large) and
 * hard-linked when it is a shared tree's file (zero-copy).  A sharded set is intake_set.c's, the
 * links into the cache intake_cache.c's; intake_run picks the one or the other. */
#include "intake_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checksum.h"
#include "delta_norm.h"
#include "fsutil.h"
#include "mapread.h"
#include "st_index.h"
#include "store.h"

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

int64_t intake__mtime_ns(const struct stat *sb)
{
    return (int64_t)sb->st_mtim.tv_sec * 1000000000 + sb->st_mtim.tv_nsec;
}

intake_status intake__io_fail(intake_req *r, int e, const char *what)
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

/* Reads len bytes at off of src into buf: 0, or the failure's status (a file that shrank is being
 * rewritten: INTAKE_INCOMPLETE). */
static intake_status read_at(intake_req *r, int src, void *buf, uint64_t len, uint64_t off)
{
    int rc = fsu_pread_all(src, buf, (size_t)len, off);
    if (rc == -ENODATA) {
        dl_fail(&r->err, DL_E_METADATA_INCOMPLETE_BUFFER, NULL, 0, "file shrank while being read");
        return INTAKE_INCOMPLETE;
    }
    return rc != 0 ? intake__io_fail(r, -rc, "reading the delta") : INTAKE_OK;
}

static intake_status write_at(intake_req *r, int dst, const void *buf, uint64_t len, uint64_t off)
{
    int rc = dst >= 0 ? fsu_pwrite_all(dst, buf, (size_t)len, off) : 0;
    return rc != 0 ? intake__io_fail(r, -rc, "writing the cache copy") : INTAKE_OK;
}

/* The buffers of copy_checked: a chunk of a tensor's data, and for a compressed key its scales and its
 * decoded values. */
typedef struct copy_bufs {
    unsigned char *data, *scales;
    float *values;
} copy_bufs;

/* A compressed key t (codes; its scales sc) chunk by chunk, both read once: decoded and checked
 * finite, its values' norm, the checksum terms of what was read, copied to dst when dst >= 0. */
static intake_status copy_compressed(intake_req *r, int src, int dst, const st_tensor *t, const st_tensor *sc,
                                     uint64_t data_start, const copy_bufs *cb, uint64_t *sum)
{
    const cz_spec *cz = &r->info.cz;
    const uint64_t per = COPY_CHUNK / sizeof(float);    /* values: a multiple of CK_BLOCK_ELEMS */
    const uint32_t mt = model_index(r, t);
    delta_norm_block nb = {{0}, 0};
    intake_status st = INTAKE_OK;

    for (uint64_t e = 0; e < t->nelem && st == INTAKE_OK; e += per) {
        uint64_t n = t->nelem - e < per ? t->nelem - e : per, soff, slen;
        uint64_t coff = data_start + t->begin + cz_code_bytes(cz->enc, e), clen = cz_code_bytes(cz->enc, n);
        delta_scales_range(cz, e, n, &soff, &slen);
        soff += data_start + sc->begin;
        if ((st = read_at(r, src, cb->data, clen, coff)) != INTAKE_OK ||
            (st = read_at(r, src, cb->scales, slen, soff)) != INTAKE_OK)
            break;
        if (delta_decode_checked(cz, t, cb->data, cb->scales, e, cb->values, (size_t)n, &r->norm, &nb, &r->err) != 0)
            return INTAKE_INVALID;
        if (dst < 0 && r->ck != NULL)
            *sum += delta_ck_compressed(r->ck, mt, cz, e, cb->data, cb->scales, n);
        if ((st = write_at(r, dst, cb->data, clen, coff)) == INTAKE_OK)
            st = write_at(r, dst, cb->scales, slen, soff);
    }
    delta_norm_flush(&r->norm, &nb);
    return st;
}

/* A plain delta tensor t chunk by chunk: checked finite, its norm, its checksum terms (dst < 0), copied
 * to dst when dst >= 0. */
static intake_status copy_plain(intake_req *r, int src, int dst, const st_tensor *t, uint64_t data_start,
                                const copy_bufs *cb, uint64_t *sum)
{
    const size_t esize = st_dtype_bits(t->dtype) / 8;
    const uint64_t per = COPY_CHUNK / esize;            /* a multiple of CK_BLOCK_ELEMS */
    const uint32_t mt = model_index(r, t);
    delta_norm_block nb = {{0}, 0};
    intake_status st = INTAKE_OK;

    for (uint64_t e = 0; e < t->nelem && st == INTAKE_OK; e += per) {
        size_t n = (size_t)(t->nelem - e < per ? t->nelem - e : per);
        uint64_t off = data_start + t->begin + e * esize;
        if ((st = read_at(r, src, cb->data, n * esize, off)) != INTAKE_OK)
            break;
        int64_t bad = delta_find_bad_value(t->dtype, cb->data, n);
        if (bad >= 0) {
            dl_fail(&r->err, DL_E_NON_FINITE, t->name, t->name_len,
                    "delta tensor holds " DELTA_BAD_VALUE_TEXT " at element %" PRIu64, e + (uint64_t)bad);
            return INTAKE_INVALID;
        }
        delta_norm_feed(&r->norm, &nb, t->dtype, cb->data, n);
        if (dst < 0 && r->ck != NULL)
            *sum += ck_blocks(r->ck, mt, t->dtype, e, cb->data, n, esize);
        st = write_at(r, dst, cb->data, n * esize, off);
    }
    delta_norm_flush(&r->norm, &nb);
    return st;
}

/* Streams the data section from src to dst (both at data_start) tensor by tensor, checking finite
 * values (a compressed key's as they decode, its scales read with its codes); dst < 0 only checks (a
 * file that is linked, not copied), and then adds the data's checksum to r->ident (a linked file stays
 * its writer's: the pass verifies what was checked).  Returns INTAKE_OK or the failure. */
static intake_status copy_tensors(intake_req *r, int src, int dst, const st_header *h, uint64_t data_start,
                                  int codes_only)
{
    copy_bufs cb = {NULL, NULL, NULL};
    intake_status st = INTAKE_OK;
    uint64_t sum = 0;
    int oom = (cb.data = malloc(COPY_CHUNK)) == NULL;

    if (!oom && r->info.cz.enc != CZ_NONE) {
        oom = (cb.scales = malloc(COPY_CHUNK / sizeof(float) / CZ_BLOCK_MIN * 4 + 4)) == NULL;
        oom = oom || (cb.values = malloc(COPY_CHUNK)) == NULL;
    }
    if (oom)
        st = intake__io_fail(r, ENOMEM, "out of memory for the copy buffer");
    for (size_t i = 0; i < h->ntensors && st == INTAKE_OK; i++) {
        const st_tensor *t = &h->tensors[i];
        if (delta_is_scales(&r->info.cz, t)) {
            continue;           /* read with its codes */
        } else if (delta_plain_dtype(t->dtype)) {
            if (!codes_only)
                st = copy_plain(r, src, dst, t, data_start, &cb, &sum);
        } else if (t->dtype == cz_code_dtype(r->info.cz.enc)) {
            /* delta_check_header matched the scales to their codes */
            const st_tensor *sc = delta_scales_of(h, t);
            st = sc != NULL ? copy_compressed(r, src, dst, t, sc, data_start, &cb, &sum)
                            : intake__io_fail(r, ENOMEM, "out of memory");
        }
    }
    free(cb.data);
    free(cb.scales);
    free(cb.values);
    if (st == INTAKE_OK && dst < 0 && r->ck != NULL) {
        r->ident.sum = sum;
        r->ident.has_sum = 1;
    }
    return st;
}

static intake_status copy_checked(intake_req *r, int src, int dst, const st_header *h, uint64_t data_start)
{
    return copy_tensors(r, src, dst, h, data_start, 0);
}

intake_status intake_check_codes(const st_header *global, int fd, const st_header *h, delta_info *info,
                                 delta_norm *norm, dl_error *err)
{
    intake_req r = {.global = global, .info = *info, .norm = *norm};
    intake_status st = copy_tensors(&r, fd, -1, h, 8 + h->header_len, 1);

    if (st == INTAKE_OK)
        *norm = r.norm;
    else
        *err = r.err;
    return st;
}

uint64_t intake__max_header(const intake_req *r)
{
    return r->max_header != 0 && r->max_header < ST_MAX_HEADER_SIZE ? r->max_header : ST_MAX_HEADER_SIZE;
}

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

/* Opens the source as a regular file, never blocking on a FIFO; a delta of the shared tree only
 * through directories of that tree (no link at any level).  0 or a negative errno; on a refused
 * type sb->st_mode says what was there. */
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
intake_status intake__open_refusal(intake_req *r, int rc, mode_t mode)
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
    return intake__io_fail(r, -rc, "opening the delta");
}

/* A safetensors file's header, read from src (size bytes): prefix, the JSON (*json, *n) and the
 * parsed header, checked to describe exactly size bytes.  INTAKE_OK or the refusal. */
intake_status intake__read_header(intake_req *r, int src, uint64_t size, unsigned char prefix[8], char **json,
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
    if (*n > intake__max_header(r)) {
        dl_fail(&r->err, DL_E_HEADER_TOO_LARGE, NULL, 0, "header too large: %" PRIu64 " bytes, the cap is %" PRIu64
                " (max_delta_header_mib)", *n, intake__max_header(r));
        return INTAKE_INVALID;
    }
    if (8 + *n > size) {
        dl_fail(&r->err, DL_E_INVALID_HEADER_LENGTH, NULL, 0, "header of %" PRIu64 " bytes not complete yet", *n);
        return INTAKE_INCOMPLETE;
    }
    *json = malloc(*n ? *n : 1);
    if (*json == NULL || fsu_pread_all(src, *json, *n, 8) != 0)
        return intake__io_fail(r, *json ? EIO : ENOMEM, "reading the header");
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
intake_status intake__copy_file(intake_req *r, int src, const struct stat *before, int dst,
                               const unsigned char prefix[8], const char *json, uint64_t n, const st_header *h)
{
    struct stat after;
    intake_status st;
    int rc;

    if ((rc = posix_fallocate(dst, 0, before->st_size)) != 0 && rc != EOPNOTSUPP && rc != EINVAL)
        return intake__io_fail(r, rc, "reserving space for the cache copy");
    if ((rc = fsu_pwrite_all(dst, prefix, 8, 0)) != 0 || (rc = fsu_pwrite_all(dst, json, n, 8)) != 0)
        return intake__io_fail(r, -rc, "writing the cache copy");
    if ((st = copy_checked(r, src, dst, h, 8 + n)) != INTAKE_OK)
        return st;
    if (fstat(src, &after) != 0 || after.st_size != before->st_size || intake__mtime_ns(&after) != intake__mtime_ns(before)) {
        dl_fail(&r->err, DL_E_IO, NULL, 0, "the file changed while it was read");
        return INTAKE_INCOMPLETE;
    }
    if (fsync(dst) != 0)
        return intake__io_fail(r, errno, "fsync of the cache copy");
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
    delta_norm norm;            /* the window's blocks' sums of squares (delta_norm.h) */
} window_check;

static int window_check_call(void *arg)
{
    window_check *w = arg;
    w->bad = delta_find_bad_value(w->dtype, w->data, w->nelem);
    if (w->bad < 0) {
        /* a window holds whole blocks of its tensor (or ends with the tensor) */
        delta_norm_block nb = {{0}, 0};
        delta_norm_feed(&w->norm, &nb, w->block_dtype, w->data, w->elems);
        delta_norm_flush(&w->norm, &nb);
    }
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
    delta_norm norm;            /* its blocks' sums of squares */
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
        delta_norm_init(&w.norm);
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
        delta_norm_merge(&c->norm, &w.norm);
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
        for (size_t k = 0; k < n; k++)
            delta_norm_merge(&r->norm, &parts[k].norm);
        r->ident.sum = sum;
        r->ident.has_sum = r->ck != NULL;
        return INTAKE_OK;
    }
    const st_tensor *t = &bad->h->tensors[bad->bad_tensor];
    dl_fail(&r->err, DL_E_NON_FINITE, t->name, t->name_len,
            "delta tensor holds " DELTA_BAD_VALUE_TEXT " at element %" PRIu64, bad->bad_elem);
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

    /* a compressed key's codes decode with its scales, read together (copy_checked) */
    if (r->info.cz.enc != CZ_NONE)
        return copy_checked(r, src, -1, h, data_start);
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
    if (fstat(src, &after) != 0 || after.st_size != before->st_size || intake__mtime_ns(&after) != intake__mtime_ns(before)) {
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
    if ((tmp = store_path_incoming_file(r->state_dir, ".link-%d-%" PRIu64, (int)getpid(), (uint64_t)before->st_ino)) ==
        NULL)
        return intake__io_fail(r, ENOMEM, "out of memory");
    (void)unlink(tmp);          /* a leftover of a crash under the same pid and inode */
    if ((r->link_errno = fsu_link_fd(src, AT_FDCWD, tmp)) != 0) {
        free(tmp);
        return intake__io_fail(r, r->link_errno, "linking the delta into the cache");
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
            return intake__io_fail(r, -rc, "checking the linked delta");
        dl_fail(&r->err, DL_E_IO, NULL, 0, "the file changed while it was taken in");
        return INTAKE_INCOMPLETE;
    }
    r->linked = 1;
    return INTAKE_OK;
}

/* Restart: our own copy in the cache, validated when it entered, is read once more for its norm
 * (delta_norm.h), which is not kept on disk.  No checksum: nobody else writes our copy. */
static intake_status read_norm(intake_req *r, int src, const st_header *h, uint64_t data_start)
{
    const ck_key *ck = r->ck;
    intake_status st;

    r->ck = NULL;               /* copy_checked's check only, which leaves ident alone without a key */
    st = copy_checked(r, src, -1, h, data_start);
    r->ck = ck;
    return st;
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
        st = intake__open_refusal(r, rc, before.st_mode);
        goto out;
    }
    r->size = (uint64_t)before.st_size;
    r->mtime_ns = intake__mtime_ns(&before);
    r->ino = (uint64_t)before.st_ino;
    if ((st = intake__read_header(r, src, r->size, prefix, &json, &n, &h)) != INTAKE_OK)
        goto out;
    if (delta_check_header(h, r->global, r->rel_path, &r->info, &r->err) != 0) {
        st = INTAKE_INVALID;
        goto out;
    }
    if (INTAKE_STALE_BASE(r, r->info.base_outer_step)) {
        st = INTAKE_STALE;
        goto out;
    }
    if (r->info.base_outer_step > r->step) {
        st = INTAKE_FUTURE;
        goto out;
    }
    if (r->in_cache) {          /* validated when it entered the cache: the header check suffices */
        if (before.st_nlink > 1) {
            if ((st = recheck_linked(r, src, &before, n, h)) != INTAKE_OK)
                goto out;
        } else if ((st = read_norm(r, src, h, 8 + n)) != INTAKE_OK) {
            goto out;
        }
        r->cache_path = strdup(r->src_path);
        st = r->cache_path ? INTAKE_OK : intake__io_fail(r, ENOMEM, "out of memory");
        goto out;
    }
    if (intake__cached_in_any_layout(r->state_dir, &r->info)) {
        st = INTAKE_DUPLICATE;
        goto out;
    }
    if (r->hub_root != NULL && !r->no_link) {
        st = link_file(r, src, &before, n, h);
        if (st != INTAKE_IO || r->link_errno == 0)
            goto out;
        /* no link here (another filesystem, links refused): copy, the data is read once more */
        dl_error_clear(&r->err);
        delta_norm_init(&r->norm);
    }
    if ((tmp = store_path_incoming_file(r->state_dir, "delta")) == NULL) {
        st = intake__io_fail(r, ENOMEM, "out of memory");
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
    if ((st = intake__copy_file(r, src, &before, dst, prefix, json, n, h)) != INTAKE_OK)
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

void intake_run(intake_req *r)
{
    dl_error_clear(&r->err);
    delta_norm_init(&r->norm);
    r->status = st_index_is_index_path(r->src_path) ? intake__set(r) : intake(r);
    /* every value was read (a cached copy taken back at a restart is read again for it) */
    r->info.has_norm = r->status == INTAKE_OK && !r->norm_unknown;
    r->info.norm = r->info.has_norm ? sqrt(delta_norm_sumsq(&r->norm)) : 0.0;
}
