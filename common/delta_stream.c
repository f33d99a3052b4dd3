#include "delta_stream.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void delta_stream_free(delta_stream *s)
{
    free(s->hbuf);
    st_header_free(s->h);
    s->hbuf = NULL;
    s->h = NULL;
}

/* Scans whole elements of the data section for non-finite values. */
static int scan_data(delta_stream *s, const unsigned char *p, size_t n, dl_error *err)
{
    uint64_t data_pos = s->pos - 8 - s->n;      /* offset in the data section of p[0] */

    while (n > 0) {
        while (s->tensor < s->h->ntensors && s->h->tensors[s->tensor].end <= data_pos) {
            delta_norm_flush(&s->norm, &s->norm_block);        /* the tensor's last block */
            s->tensor++;
        }
        if (s->tensor >= s->h->ntensors)
            return dl_fail(err, DL_E_METADATA_INCOMPLETE_BUFFER, NULL, 0,
                           "incomplete metadata, file not fully covered: bytes after the last tensor");
        const st_tensor *t = &s->h->tensors[s->tensor];
        size_t esize = st_dtype_bits(t->dtype) / 8;
        uint64_t in_tensor = t->end - data_pos;
        size_t take = n < in_tensor ? n : (size_t)in_tensor;
        size_t i = 0;
        if (!delta_plain_dtype(t->dtype) || delta_may_be_scales(s->global, t)) {
            /* a compressed key's codes or scales: decoded together once the file is whole
             * (delta_stream_finish leaves the norm to that check) */
            p += take;
            n -= take;
            s->pos += take;
            data_pos += take;
            continue;
        }
        /* complete an element split by the previous feed */
        if (s->carry_len > 0) {
            size_t need = esize - s->carry_len;
            size_t k = take < need ? take : need;
            memcpy(s->carry + s->carry_len, p, k);
            s->carry_len += k;
            i = k;
            if (s->carry_len == esize) {
                if (delta_find_bad_value(t->dtype, s->carry, 1) >= 0)
                    return dl_fail(err, DL_E_NON_FINITE, t->name, t->name_len,
                                   "delta tensor holds " DELTA_BAD_VALUE_TEXT " at element %" PRIu64,
                                   (data_pos - t->begin) / esize);
                delta_norm_feed(&s->norm, &s->norm_block, t->dtype, s->carry, 1);
                s->carry_len = 0;
            }
        }
        size_t whole = (take - i) / esize;
        if (whole > 0) {
            /* the checker reads aligned lanes: copy if p is not aligned for the element size */
            const unsigned char *q = p + i;
            int64_t bad;
            if (((uintptr_t)q % esize) != 0) {
                _Alignas(8) unsigned char tmp[4096];
                size_t done = 0;
                bad = -1;
                while (done < whole && bad < 0) {
                    size_t chunk = (whole - done) * esize > sizeof(tmp) ? sizeof(tmp) / esize : whole - done;
                    memcpy(tmp, q + done * esize, chunk * esize);
                    bad = delta_find_bad_value(t->dtype, tmp, chunk);
                    if (bad >= 0)
                        bad += (int64_t)done;
                    else
                        delta_norm_feed(&s->norm, &s->norm_block, t->dtype, tmp, chunk);
                    done += chunk;
                }
            } else {
                bad = delta_find_bad_value(t->dtype, q, whole);
                if (bad < 0)
                    delta_norm_feed(&s->norm, &s->norm_block, t->dtype, q, whole);
            }
            if (bad >= 0)
                return dl_fail(err, DL_E_NON_FINITE, t->name, t->name_len,
                               "delta tensor holds " DELTA_BAD_VALUE_TEXT " at element %" PRIu64,
                               (data_pos + i - t->begin) / esize + (uint64_t)bad);
            i += whole * esize;
        }
        if (i < take) {                     /* a partial element: keep it for the next feed */
            memcpy(s->carry, p + i, take - i);
            s->carry_len = take - i;
        }
        p += take;
        n -= take;
        data_pos += take;
        s->pos += take;
    }
    return 0;
}

/* The header parsed and its file length checked against the declared body, no delta rules. */
static int header_parse(delta_stream *s, dl_error *err)
{
    int rc;

    if ((rc = st_header_parse_unsized(s->hbuf, (size_t)s->n, &s->h, err)) != 0)
        return rc;
    free(s->hbuf);
    s->hbuf = NULL;
    if (st_header_file_len(s->h, &s->file_len) != 0)
        return dl_fail(err, DL_E_VALIDATION_OVERFLOW, NULL, 0, "file size overflows");
    if (s->declared_len != 0 && s->declared_len != s->file_len)
        return dl_fail(err, DL_E_METADATA_INCOMPLETE_BUFFER, NULL, 0,
                       "incomplete metadata, file not fully covered: the header describes %" PRIu64
                       " bytes, the request body has %" PRIu64,
                       s->file_len, s->declared_len);
    return 0;
}

static int header_complete(delta_stream *s, dl_error *err)
{
    int rc = header_parse(s, err);
    if (rc != 0)
        return rc;
    return delta_check_header(s->h, s->global, s->path, &s->info, err);
}

int delta_stream_feed(delta_stream *s, const char *data, size_t n, dl_error *err)
{
    const unsigned char *p = (const unsigned char *)data;
    int header_now = 0, rc;

    while (n > 0) {
        if (s->pos < 8) {
            size_t k = 8 - (size_t)s->pos < n ? 8 - (size_t)s->pos : n;
            memcpy(s->prefix + s->pos, p, k);
            s->pos += k;
            p += k;
            n -= k;
            if (s->pos == 8) {
                for (int i = 7; i >= 0; i--)
                    s->n = (s->n << 8) | s->prefix[i];
                /* what the format refuses first (the file's words for it), then this server's cap */
                if (s->n > ST_MAX_HEADER_SIZE)
                    return st_prefix_refusal(err, DL_E_HEADER_TOO_LARGE, s->prefix, s->n, s->declared_len);
                if (s->declared_len != 0 && 8 + s->n > s->declared_len)
                    return st_prefix_refusal(err, DL_E_INVALID_HEADER_LENGTH, s->prefix, s->n, s->declared_len);
                if (s->n > s->max_header)
                    return dl_fail(err, DL_E_HEADER_TOO_LARGE, NULL, 0,
                                   "header too large: %" PRIu64 " bytes, the cap is %" PRIu64 " (max_delta_header_mib)",
                                   s->n, s->max_header);
                if ((s->hbuf = malloc(s->n ? (size_t)s->n : 1)) == NULL)
                    return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory for the header");
                if (s->n == 0) {
                    if (s->defer_header)
                        return DELTA_STREAM_HEADER_READY;
                    if ((rc = header_complete(s, err)) != 0)
                        return rc;
                }
            }
            continue;
        }
        if (s->h == NULL) {
            uint64_t have = s->pos - 8;
            size_t k = s->n - have < n ? (size_t)(s->n - have) : n;
            memcpy(s->hbuf + have, p, k);
            s->pos += k;
            p += k;
            n -= k;
            if (s->pos == 8 + s->n) {
                if (s->defer_header)
                    return n == 0 ? DELTA_STREAM_HEADER_READY
                                  : dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "fed past a deferred header");
                if ((rc = header_complete(s, err)) != 0)
                    return rc;
                header_now = 1;
            }
            continue;
        }
        if (s->pos + n > s->file_len)
            return dl_fail(err, DL_E_METADATA_INCOMPLETE_BUFFER, NULL, 0,
                           "incomplete metadata, file not fully covered: more bytes than the header describes");
        if ((rc = scan_data(s, p, n, err)) != 0)
            return rc;
        n = 0;
    }
    return header_now ? DELTA_STREAM_HEADER : DELTA_STREAM_MORE;
}

size_t delta_stream_room(const delta_stream *s, size_t n)
{
    uint64_t end;

    if (s->h != NULL)
        return n;
    if (s->pos < 8)
        end = 8;
    else if (s->hbuf != NULL && s->pos < 8 + s->n)
        end = 8 + s->n;
    else
        return 0;               /* the header bytes are in, waiting for delta_stream_parse_header */
    return end - s->pos < n ? (size_t)(end - s->pos) : n;
}

int delta_stream_parse_header(delta_stream *s, dl_error *err)
{
    if (s->h != NULL || s->hbuf == NULL || s->pos != 8 + s->n)
        return dl_fail(err, DL_E_INVALID_HEADER_LENGTH, NULL, 0, "the header is not complete");
    return header_complete(s, err);
}

int delta_stream_parse_header_only(delta_stream *s, dl_error *err)
{
    if (s->h != NULL || s->hbuf == NULL || s->pos != 8 + s->n)
        return dl_fail(err, DL_E_INVALID_HEADER_LENGTH, NULL, 0, "the header is not complete");
    return header_parse(s, err);
}

int delta_stream_finish(delta_stream *s, dl_error *err)
{
    if (s->pos < 8)
        return dl_fail(err, DL_E_HEADER_TOO_SMALL, NULL, 0, "body of %" PRIu64 " bytes is shorter than 8", s->pos);
    if (s->h == NULL)
        return dl_fail(err, DL_E_INVALID_HEADER_LENGTH, NULL, 0, "body ended inside the %" PRIu64 "-byte header", s->n);
    if (s->pos != s->file_len)
        return dl_fail(err, DL_E_METADATA_INCOMPLETE_BUFFER, NULL, 0,
                       "incomplete metadata, file not fully covered: the header describes %" PRIu64
                       " bytes, the body had %" PRIu64,
                       s->file_len, s->pos);
    delta_norm_flush(&s->norm, &s->norm_block);
    if (s->info.cz.enc == CZ_NONE) {
        s->info.norm = sqrt(delta_norm_sumsq(&s->norm));
        s->info.has_norm = 1;
    }
    return 0;
}
