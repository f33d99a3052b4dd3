/* store_view: the downlink's part of the state tree (store.h; README, "The downlink"): the view of the
 * committed step and the updates kept, their names, their record in outer_metadata.json and in the
 * redo record, and which of their files cleanup keeps.  Kept apart from store.c, which holds the rest
 * of the commit protocol. */
#include "store.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cJSON.h>

#include "blockhash.h"
#include "compress.h"
#include "strbuf.h"

char *store_view_path(const store *s, uint64_t step)
{
    char *p = NULL;
    return asprintf(&p, "%s/global/view-%" PRIu64 ".safetensors", s->dir, step) < 0 ? NULL : p;
}

char *store_update_path(const store *s, uint64_t step)
{
    char *p = NULL;
    return asprintf(&p, "%s/global/update-%" PRIu64 ".safetensors", s->dir, step) < 0 ? NULL : p;
}

void store__view_json(sbuf *b, const store_view *v)
{
    char num[160], hex[65];

    blockhash_hex(v->hash, hex);
    snprintf(num, sizeof(num), ",\n  \"view\": {\"encoding\": \"%s\", \"chain_from\": %" PRIu64 ", \"hash\": \"%s\"}",
             cz_encoding_name((cz_encoding)v->enc), v->chain_from, hex);
    sb_str(b, num);
}

static int hex_parse(const char *s, unsigned char out[32])
{
    if (strlen(s) != 64)
        return -1;
    for (int i = 0; i < 32; i++) {
        int hi = dl_hex_digit((unsigned char)s[2 * i]), lo = dl_hex_digit((unsigned char)s[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return -1;
        out[i] = (unsigned char)(hi << 4 | lo);
    }
    return 0;
}

/* outer_metadata.json's "view" (absent: the committed step's view is its global, the chain starts
 * there).  0, or -1 when damaged. */
int store__view_parse(store *s, const cJSON *v)
{
    const cJSON *enc, *from, *hash;
    cz_encoding e;

    memset(&s->view, 0, sizeof(s->view));
    s->view.chain_from = s->step;
    if (v == NULL)
        return 0;
    enc = cJSON_GetObjectItemCaseSensitive(v, "encoding");
    from = cJSON_GetObjectItemCaseSensitive(v, "chain_from");
    hash = cJSON_GetObjectItemCaseSensitive(v, "hash");
    if (!cJSON_IsObject(v) || !cJSON_IsString(enc) || !cJSON_IsNumber(from) || !cJSON_IsString(hash) ||
        cz_encoding_parse(enc->valuestring, strlen(enc->valuestring), &e) != 0 || e == CZ_INT8_BLOCK ||
        !(from->valuedouble >= 0) || from->valuedouble >= (double)s->step ||
        from->valuedouble != (double)(uint64_t)from->valuedouble || hex_parse(hash->valuestring, s->view.hash) != 0)
        return -1;
    s->view.enc = (int)e;
    s->view.chain_from = (uint64_t)from->valuedouble;
    s->view.hashed = 1;
    return (s->view_path = store_view_path(s, s->step)) != NULL ? 0 : -1;
}

int store__view_apply(store *s, const store_commit_info *info)
{
    char *p = info->view != NULL ? store_view_path(s, info->step) : NULL;

    if (info->view != NULL && p == NULL)
        return -1;
    free(s->view_path);
    s->view_path = p;
    if (info->view != NULL) {
        s->view = *info->view;
    } else {
        memset(&s->view, 0, sizeof(s->view));
        s->view.chain_from = info->step;
    }
    return 0;
}

/* global/view-<k> and global/update-<k>: 1 keep, 0 remove, -1 not one of them.  At startup only the
 * committed step's view and its chain's last updates_keep updates stay (a later step's are leftovers
 * of an uncommitted step, which its redo record makes again); after a commit, the next step's may be
 * being written too. */
int store__keep_view(const store *s, const char *name, int (*match)(const char *, const char *, const char *, uint64_t *))
{
    uint64_t step;

    if (match(name, "view-", ".safetensors", &step) == 0)
        return s->committed && (s->startup ? step == s->step && s->view_path != NULL : step >= s->step);
    if (match(name, "update-", ".safetensors", &step) == 0)
        return s->committed && step > s->view.chain_from && step + s->updates_keep > s->step &&
               (!s->startup || step <= s->step);
    return -1;
}

const char *store_redo_downlink_name(int enc)
{
    return enc == CZ_NONE ? NULL : cz_encoding_name((cz_encoding)enc);
}

int store__redo_downlink_parse(const cJSON *v, int *enc)
{
    cz_encoding e;

    *enc = CZ_NONE;
    if (v == NULL)
        return 0;
    if (!cJSON_IsString(v) || cz_encoding_parse(v->valuestring, strlen(v->valuestring), &e) != 0 ||
        e == CZ_INT8_BLOCK)
        return -1;
    *enc = (int)e;
    return 0;
}
