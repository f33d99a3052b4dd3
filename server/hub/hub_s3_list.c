/* hub_s3_list: the s3:// poll's walk of the nodes/ listing (hub_s3.c starts it after the step file):
 * ListObjectsV2 page by page, fair per node (a poll that fills a table stops at a node's boundary and the next
 * starts after it), the best delta of each node in sync mode or a node's deltas in local-step order in async
 * mode, the shards listed matched to their indexes after the last page, the candidates handed to the fetch
 * pipeline (remote_fetch.h). */
#include "hub.h"
#include "hub_s3.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "delta.h"
#include "dl_log.h"
#include "hub_s3_internal.h"
#include "remote.h"
#include "remote_fetch.h"

/* listing bytes read per poll: a page of 1,000 keys is about 300 KiB, so this is some 200 pages; a
 * server that sends 4 MiB pages (or loops its token) costs at most this much XML per poll */
#define MAX_LIST_BYTES_PER_POLL (64ull << 20)
/* Caps of one poll, fair per node: a node's keys are contiguous in the sorted listing, so a poll that fills
 * a table stops at the boundary of the node that did not fit, and the next poll starts there
 * (start-after), where the listing's first page would otherwise make the same nodes win every time. */
#define MAX_NODES_PER_LISTING 8192
#define MAX_SHARDS_PER_LISTING 65536
/* shards remembered of one node: its one set's (more than any model's tensors need; a node that lists
 * more has its extra shards ignored, and its set is incomplete) */
#define MAX_SHARDS_PER_NODE 16384
/* async mode: a node's deltas handed over per poll, the lowest local steps not handled yet (the others
 * wait for the next polls, and are counted) */
#define ASYNC_DELTAS_PER_NODE 16

/* ---- the nodes/ listing ------------------------------------------------------------------------ */

void s3_best_reset(s3_hub *h)
{
    for (size_t i = 0; i < h->nbest; i++)
        free(h->best[i].key);
    free(h->best);
    h->best = NULL;
    h->nbest = 0;
    for (size_t i = 0; i < h->nshards; i++)
        free(h->shards[i].obj.key);
    free(h->shards);
    h->shards = NULL;
    h->nshards = h->shards_cap = 0;
    h->list_pages = 0;
    h->list_bytes = 0;
    free(h->list_tokens);
    h->list_tokens = NULL;
    free(h->node_boundary);
    free(h->prev_key);
    h->node_boundary = h->prev_key = NULL;
    h->cur_node[0] = '\0';
    h->cur_node_shards = 0;
    h->list_full = 0;
    h->list_waiting = 0;
    h->cur_node_in_flight = 0;
}

/* Forgets what this poll remembered of node (a node the poll stops in: the next one lists it whole). */
static void forget_node(s3_hub *h, const char *node)
{
    for (size_t i = 0; i < h->nbest;) {
        if (strcmp(h->best[i].node, node) == 0) {
            free(h->best[i].key);
            h->best[i] = h->best[--h->nbest];
        } else {
            i++;
        }
    }
    for (size_t i = 0; i < h->nshards;) {
        if (strcmp(h->shards[i].node, node) == 0) {
            free(h->shards[i].obj.key);
            h->shards[i] = h->shards[--h->nshards];
        } else {
            i++;
        }
    }
}

/* A copy of a key the listing walk remembers, NULL for NULL; NULL when out of memory too (then a
 * poll that stops resumes from the top, as when it knows no boundary). */
static char *dup_key(const char *key)
{
    return key != NULL ? strdup(key) : NULL;
}

/* The poll stops before the current node: it is forgotten, and the next poll starts with it (after
 * node_boundary); when it is the poll's first node, after the whole node (it alone is over a cap). */
static void stop_before_node(s3_hub *h)
{
    char *next = NULL;

    if (h->node_boundary != NULL) {
        next = dup_key(h->node_boundary);
    } else if (h->cur_node[0] != '\0') {
        /* "<prefix>/nodes/<node>0" sorts after every "<prefix>/nodes/<node>/..." and before the next node */
        char *dir = s3_full_key(h, "nodes/");
        if (dir != NULL && asprintf(&next, "%s%s0", dir, h->cur_node) < 0)
            next = NULL;
        free(dir);
    }
    if (h->cur_node[0] != '\0')
        forget_node(h, h->cur_node);
    free(h->resume_after);
    h->resume_after = next;
    h->list_full = 1;
}

/* Keeps track of the node boundary the listing is at (keys sorted: a node's keys are contiguous).  0, or
 * -1 when the poll must stop here (a table is full and key begins a new node). */
static int enter_node(s3_hub *h, const char *key, const char *node)
{
    if (strcmp(h->cur_node, node) == 0)
        goto same;
    if (h->nbest == MAX_NODES_PER_LISTING || h->nshards == MAX_SHARDS_PER_LISTING) {
        /* the previous node is whole; this one starts the next poll */
        free(h->resume_after);
        h->resume_after = dup_key(h->prev_key);
        h->list_full = 1;
        return -1;
    }
    free(h->node_boundary);
    h->node_boundary = h->prev_key;
    h->prev_key = NULL;
    snprintf(h->cur_node, sizeof(h->cur_node), "%s", node);
    h->cur_node_shards = 0;
    h->cur_node_in_flight = 0;
same:
    free(h->prev_key);
    h->prev_key = dup_key(key);
    return 0;
}

/* A shard is remembered for the index of its node and step, if one is the node's best.  0, or -1 when
 * it was not. */
static int remember_shard(s3_hub *h, const s3_object *o, const delta_path *dp)
{
    if (h->nshards == h->shards_cap) {
        size_t cap = h->shards_cap ? 2 * h->shards_cap : 64;
        if (h->shards_cap == MAX_SHARDS_PER_LISTING)
            return -1;
        if (cap > MAX_SHARDS_PER_LISTING)
            cap = MAX_SHARDS_PER_LISTING;
        shard_entry *ns = realloc(h->shards, cap * sizeof(*ns));
        if (ns == NULL)
            return -1;
        h->shards = ns;
        h->shards_cap = cap;
    }
    shard_entry *e = &h->shards[h->nshards];
    memset(e, 0, sizeof(*e));
    if ((e->obj.key = strdup(o->key)) == NULL)
        return -1;
    snprintf(e->node, sizeof(e->node), "%s", dp->node_id);
    e->local_step = dp->local_step;
    e->obj.size = o->size;
    snprintf(e->obj.etag, sizeof(e->obj.etag), "%s", o->etag);
    h->nshards++;
    return 0;
}

static int best_set(best_entry *b, const s3_object *o, const delta_path *dp)
{
    char *k = strdup(o->key);

    if (k == NULL)
        return -1;
    free(b->key);
    b->key = k;
    b->local_step = dp->local_step;
    b->is_index = dp->kind == DELTA_PATH_INDEX;
    b->size = o->size;
    snprintf(b->etag, sizeof(b->etag), "%s", o->etag);
    return 0;
}

/* A new entry of node at the end of the table (NULL: full, or out of memory). */
static best_entry *best_append(s3_hub *h, const char *node)
{
    if (h->nbest >= MAX_NODES_PER_LISTING)
        return NULL;
    best_entry *nb = realloc(h->best, (h->nbest + 1) * sizeof(*nb));
    if (nb == NULL)
        return NULL;
    h->best = nb;
    memset(&h->best[h->nbest], 0, sizeof(h->best[h->nbest]));
    snprintf(h->best[h->nbest].node, sizeof(h->best[h->nbest].node), "%s", node);
    return &h->best[h->nbest++];
}

/* Async mode: every delta is an update, none supersedes another, so a node's single files not handled
 * yet are kept, its ASYNC_DELTAS_PER_NODE lowest local steps per poll (the others are counted and
 * wait: the seen list knows the handled ones, so the next poll resumes where this one stopped).  A
 * set is kept as in sync mode: the node's newest index. */
static void consider_async(s3_hub *h, const s3_object *o, const char *rel, const delta_path *dp)
{
    size_t mine = 0, worst = SIZE_MAX, index = SIZE_MAX;
    int is_new;

    for (size_t i = 0; i < h->nbest; i++) {
        if (strcmp(h->best[i].node, dp->node_id) != 0)
            continue;
        if (h->best[i].is_index) {
            index = i;
            continue;
        }
        mine++;
        if (worst == SIZE_MAX || h->best[i].local_step > h->best[worst].local_step)
            worst = i;
    }
    if (dp->kind == DELTA_PATH_INDEX) {
        best_entry *b = index != SIZE_MAX ? &h->best[index] : NULL;
        if (b != NULL && dp->local_step <= b->local_step)
            return;
        if (b == NULL && (b = best_append(h, dp->node_id)) == NULL)
            return;
        (void)best_set(b, o, dp);       /* out of memory: its old key stays, or an empty entry is skipped */
        return;
    }
    if (remote_fetch_wanted(&h->f, rel, o->etag, &is_new) <= 0) {
        /* handled: the poll goes past it; in flight: it holds one of the node's places, so a busy
         * daemon is not sent more of a node's deltas than that */
        if (remote_fetch_in_flight(&h->f, rel, o->etag))
            h->cur_node_in_flight++;
        return;
    }
    if (mine + h->cur_node_in_flight < ASYNC_DELTAS_PER_NODE) {
        best_entry *b = best_append(h, dp->node_id);
        if (b == NULL || best_set(b, o, dp) != 0)
            h->list_waiting++;  /* the table is full: the next poll */
        return;
    }
    h->list_waiting++;          /* this one, or the one it displaces */
    if (worst != SIZE_MAX && dp->local_step < h->best[worst].local_step)
        (void)best_set(&h->best[worst], o, dp);
}

/* Keeps obj if it is the highest local step of its node seen in this listing (a file or an index;
 * shards are kept aside for their index); async mode: consider_async. */
static void consider_object(s3_hub *h, const s3_object *o, const char *rel)
{
    const char *node;
    uint64_t local_step;
    delta_path dp;
    size_t i;

    if (h->list_full || delta_parse_any_path(rel, &dp, NULL) != 0)
        return;                 /* not a delta's name: nothing of ours (temporary names, other files) */
    if (enter_node(h, o->key, dp.node_id) != 0)
        return;
    if (dp.kind == DELTA_PATH_SHARD) {
        if (h->cur_node_shards < MAX_SHARDS_PER_NODE && remember_shard(h, o, &dp) == 0)
            h->cur_node_shards++;
        return;
    }
    if (h->f.limits.async) {
        consider_async(h, o, rel, &dp);
        return;
    }
    node = dp.node_id;
    local_step = dp.local_step;
    for (i = 0; i < h->nbest; i++)
        if (strcmp(h->best[i].node, node) == 0)
            break;
    if (i == h->nbest) {
        if (h->nbest == MAX_NODES_PER_LISTING)
            return;
        best_entry *nb = realloc(h->best, (h->nbest + 1) * sizeof(*nb));
        if (nb == NULL)
            return;
        h->best = nb;
        memset(&h->best[i], 0, sizeof(h->best[i]));
        snprintf(h->best[i].node, sizeof(h->best[i].node), "%s", node);
        h->nbest++;
    } else if (local_step <= h->best[i].local_step) {
        return;
    }
    char *k = strdup(o->key);
    if (k == NULL)
        return;
    free(h->best[i].key);
    h->best[i].key = k;
    h->best[i].local_step = local_step;
    h->best[i].is_index = dp.kind == DELTA_PATH_INDEX;
    h->best[i].size = o->size;
    snprintf(h->best[i].etag, sizeof(h->best[i].etag), "%s", o->etag);
}

/* The shards listed next to an index (same node and step) and the set's version.  0 or -1. */
static int set_listed(s3_hub *h, const best_entry *b, remote_listed **out, size_t *n, char *ver, size_t ver_size)
{
    remote_listed *l = NULL;
    size_t k = 0;

    for (size_t i = 0; i < h->nshards; i++) {
        const shard_entry *e = &h->shards[i];
        if (e->local_step != b->local_step || strcmp(e->node, b->node) != 0)
            continue;
        remote_listed o = {.key = e->obj.key, .size = e->obj.size};
        snprintf(o.tag, sizeof(o.tag), "%s", e->obj.etag);
        if (remote_listed_add(&l, &k, &o) != 0) {
            remote_listed_free(l, k);
            return -1;
        }
    }
    if (remote_fetch_set_version(b->etag, l, k, ver, ver_size) != 0) {
        remote_listed_free(l, k);
        return -1;
    }
    *out = l;
    *n = k;
    return 0;
}

static int best_cmp(const void *a, const void *b)
{
    const best_entry *x = a, *y = b;
    int c = strcmp(x->node, y->node);
    return c != 0 ? c : x->local_step < y->local_step ? -1 : x->local_step > y->local_step;
}

/* After the last page: each node's newest delta (async: its deltas kept, in local-step order), unless
 * it was handled already. */
static void listing_complete(s3_hub *h)
{
    size_t plen = h->prefix[0] ? strlen(h->prefix) + 1 : 0;

    if (h->f.limits.async) {
        if (h->nbest > 1)
            qsort(h->best, h->nbest, sizeof(*h->best), best_cmp);
        if (h->list_waiting > 0 && h->list_waiting != h->st.deltas_waiting)
            dl_log(DL_LOG_INFO, "hub", "deltas wait for a later poll (each node's are taken in local-step order, "
                                       "a few per poll)",
                   "waiting=%" PRIu64 " per_node=%d", h->list_waiting, ASYNC_DELTAS_PER_NODE);
        h->st.deltas_waiting = h->list_waiting;
        h->st.deltas_deferred += h->list_waiting;
    }
    for (size_t i = 0; i < h->nbest; i++) {
        best_entry *b = &h->best[i];
        if (b->key == NULL)
            continue;           /* an entry whose key could not be copied */
        const char *rel = b->key + plen;
        remote_listed *listed = NULL;
        size_t nlisted = 0;
        char ver[80];
        snprintf(ver, sizeof(ver), "%s", b->etag);
        if (b->is_index && set_listed(h, b, &listed, &nlisted, ver, sizeof(ver)) != 0)
            continue;
        int is_new;
        remote_cand *c = NULL;
        /* new, or a later round's delta that is looked at again; pending, done or given up: not */
        if (remote_fetch_wanted(&h->f, rel, ver, &is_new) <= 0 ||
            (c = remote_cand_new(rel, b->key, b->etag, b->size)) == NULL || remote_fetch_pending(&h->f, rel, ver) != 0) {
            remote_cand_free(c);
            remote_listed_free(listed, nlisted);
            continue;
        }
        snprintf(c->ver, sizeof(c->ver), "%s", ver);
        c->is_set = b->is_index;
        c->listed = listed;
        c->nlisted = nlisted;
        remote_fetch_enqueue(&h->f, c);
    }
    s3_best_reset(h);
    s3_poll_finish(h);
}

/* 1 when this poll met token before (a server that loops its continuation token), else remembers it.
 * At most MAX_LIST_PAGES tokens a poll; a missing token counts as repeated (no way to go on). */
static int token_repeated(s3_hub *h, const char *token)
{
    uint64_t x = 1469598103934665603ull;
    if (token == NULL || !*token)
        return 1;
    for (const unsigned char *c = (const unsigned char *)token; *c; c++)
        x = (x ^ *c) * 1099511628211ull;        /* FNV-1a */
    for (unsigned i = 0; h->list_tokens && i < h->list_pages; i++)
        if (h->list_tokens[i] == x)
            return 1;
    if (h->list_tokens == NULL && (h->list_tokens = calloc(MAX_LIST_PAGES, sizeof(*h->list_tokens))) == NULL)
        return 1;
    h->list_tokens[h->list_pages] = x;
    return 0;
}

static void list_done(s3_hub *h, s3_req *r, int ok)
{
    s3_listing l;
    dl_error err = {0};
    char why[256];
    size_t plen = h->prefix[0] ? strlen(h->prefix) + 1 : 0;

    if (!ok || h->f.closing) {
        if (!h->f.closing && r->x) {
            s3_describe_answer(r->x, why, sizeof(why));
            set_error(h, "listing s3://%s/%s: %s", h->bucket, r->what, why);
        }
        remote_req_end(r);
        s3_best_reset(h);
        if (!h->f.closing)
            s3_poll_finish(h);
        return;
    }
    if (s3_parse_listing(r->x->body.p, r->x->body.len, &l, &err) != 0) {
        set_error(h, "listing s3://%s/%s: %s", h->bucket, r->what, err.message);
        remote_req_end(r);
        s3_best_reset(h);
        s3_poll_finish(h);
        return;
    }
    size_t r_len = r->x->body.len;
    remote_req_end(r);
    for (size_t i = 0; i < l.n; i++) {
        /* the server answers for the prefix we asked; anything else is not ours to read */
        if (strncmp(l.objs[i].key, h->prefix, plen ? plen - 1 : 0) != 0 || (plen && l.objs[i].key[plen - 1] != '/'))
            continue;
        consider_object(h, &l.objs[i], l.objs[i].key + plen);
    }
    h->list_bytes += r_len;
    const char *stop = NULL;
    if (l.truncated && h->list_pages + 1 >= MAX_LIST_PAGES)
        stop = "more than 1000 pages";
    else if (l.truncated && h->list_bytes >= MAX_LIST_BYTES_PER_POLL)
        stop = "more than 64 MiB of listing";
    else if (l.truncated && token_repeated(h, l.next_token))
        stop = "the server repeated a continuation token";
    if (h->list_full) {
        /* a table filled at a node boundary: the next poll starts there */
        listing_complete(h);
    } else if (l.truncated && stop == NULL) {
        h->list_pages++;
        s3_list_page(h, l.next_token);
    } else {
        if (stop != NULL) {
            set_error(h, "listing s3://%s/%s/nodes/: %s, the poll ends there", h->bucket, h->prefix, stop);
            stop_before_node(h);        /* the next poll goes on from the node it stopped in */
        } else {
            free(h->resume_after);      /* the whole listing was read: the next poll starts at the top */
            h->resume_after = NULL;
        }
        listing_complete(h);
    }
    s3_listing_free(&l);
}

void s3_list_page(s3_hub *h, const char *token)
{
    char *prefix = s3_full_key(h, "nodes/");
    char *query = prefix ? s3_list_query(prefix, token, token == NULL ? h->resume_after : NULL, S3_MAX_KEYS_PER_PAGE) : NULL;
    s3_req *r = query ? s3_req_new(h, "GET", NULL, query, "list") : NULL;

    if (r != NULL) {
        free(r->what);
        r->what = prefix;
        prefix = NULL;
    }
    free(prefix);
    free(query);
    if (r == NULL) {
        s3_best_reset(h);
        s3_poll_finish(h);
        return;
    }
    s3_req_go(h, r, list_done, NULL);
}
