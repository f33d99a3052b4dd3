/* The file:// transport (hub.h): a shared directory laid out like the Hub repo.
 *
 * Polling is a scan of root/nodes on the libuv pool (hub_file.c reads the tree as hostile) every poll
 * interval, and at once when inotify says something changed: nodes/ itself (a new node directory)
 * and every node directory a scan has read (a delta renamed into an existing directory is seen in
 * milliseconds, not at the next poll).  Where inotify does not work, the periodic scan still finds
 * everything.
 *
 * Each delta file is remembered by path and version (size, mtime, inode) in a seen map: a version is
 * handed to the daemon once; one that is still being written (intake says INCOMPLETE) is retried
 * while it changes and rejected once it has stopped changing for the settle time; junk in the tree
 * (a link, a FIFO, a misnamed file, an unreadable step file) is logged once per version.  The map
 * follows the tree: entries no longer listed are forgotten after each complete scan.
 *
 * In async mode (hub_limits.async) every delta is an update: each node directory is listed in
 * local-step order from its resume point (hub_file.h's hub_resume), which moves past the decided
 * deltas that begin its listing after each complete scan; a node with more deltas than a scan lists
 * is scanned again as they are decided.  Sync mode lists each node's newest few, as ever.
 *
 * A sharded delta (hub.h, "Sharded checkpoints") is one entry of the seen map, under its index's
 * path, with an identity that covers every file of the set (hub_candidate in hub_file.h: sizes
 * summed, the latest mtime, the index's inode mixed with each shard's inode, size and mtime): a
 * shard rewritten or arriving makes it a new version, so the settle time restarts and a rewritten
 * set is taken again.  It is handed over once the index and every shard it lists are there; a
 * partial set waits without a word (one debug line per set).  An index that does not parse may be
 * still being written (json.dump writes in pieces): it is handed over, for intake to refuse with its
 * reason, only once it has stopped changing for the settle time.  Shard files are never handed over
 * alone.  What a scan learnt of each version of an index (index_parse.h: by its identity, device,
 * inode, size, mtime and ctime) is remembered in the memo, so the index is read and parsed once per
 * version, not at every poll; the parse itself goes with the set when it is handed over, and intake
 * uses it rather than reading the index again (a set refused at a shard comes back whenever a shard
 * is touched).
 *
 * Publishing copies the step's global into root/global, then writes step_count.json (each atomic);
 * a sharded global (an index path) publishes its shards, then the index, then step_count.json, and
 * the other layout's files go last.  Adoption copies root/global/latest.safetensors (or the index and
 * its shards, into a directory of their own) into the state directory through descriptors that never
 * leave the tree. */
#include "hub.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "delta.h"
#include "dl_log.h"
#include "fsutil.h"
#include "hub_file.h"
#include "jobs.h"
#include "seen.h"
#include "st_index.h"
#include "store.h"
#include "util.h"

/* inotify watches on node directories: one per directory a scan read, up to this many (a round
 * has far fewer nodes; beyond it the periodic scan still finds everything) */
#define MAX_NODE_WATCHES 1024

typedef struct file_hub file_hub;

typedef struct node_watch {
    uv_fs_event_t h;
    file_hub *fh;
    uint64_t listed;            /* the last scan that read this directory */
    char rel[];                 /* nodes/<id> */
} node_watch;

struct file_hub {
    hub base;
    uv_loop_t *loop;
    hub_callbacks cb;
    void *app;
    char *root, *state_dir, *incoming;
    hub_downlink dl;            /* the next publish's downlink files (dl_on), paths owned */
    int dl_on;
    double poll_interval;
    uint64_t max_header;        /* cap on the published global's header (a delta's: max_delta_header_mib) */
    uv_timer_t poll_timer;
    uv_fs_event_t nodes_watch;
    int nodes_watch_open;
    node_watch **watches;
    size_t nwatches;
    seen_map seen;
    hub_index_memo *memo;       /* read by the scan in flight, replaced only when it is done (the parses it
                                   holds are shared by reference with that scan and with intakes) */
    size_t nmemo;
    int async;                  /* hub_limits.async: each node directory listed from its resume point */
    hub_resume *resume;         /* async: where each node's listing resumes; like the memo, read by the scan
                                   in flight and replaced only when it is done */
    size_t nresume;
    uint64_t scan_gen;          /* scans completed (seen entries are stamped with the last listing) */
    int scan_in_flight, scan_again;
    uint64_t step;
    int waiting;
    int reported;               /* published_seen was called at least once */
    int64_t reported_step;
    int adopt_in_flight, publishing;
    int started;                /* start() ran: polling */
    int creates_root;           /* the root did not exist at open (--create-hub): start makes it, loudly */
    job_owner jobs;             /* pool jobs out (jobs.h) */
    unsigned handles;           /* handles open */
    int closing;
    void (*close_done)(void *);
    void *close_arg;
    hub_status st;
};

static double now_s(const file_hub *fh)
{
    return (double)uv_now(fh->loop) / 1000.0;
}

/* Counts a failure and says it: at error level when it is news, at debug level when it is the last
 * one again (a broken global in the tree is met at every poll until someone replaces it). */
static void set_error(file_hub *fh, const char *what, const dl_error *err)
{
    char q[600], text[sizeof(fh->st.last_error)];
    fh->st.errors++;
    snprintf(text, sizeof(text), "%s: %.230s", what, err->message);
    int again = strcmp(text, fh->st.last_error) == 0;
    memcpy(fh->st.last_error, text, sizeof(text));
    dl_log(again ? DL_LOG_DEBUG : DL_LOG_ERROR, "hub", what, "code=%s error=%s", dl_error_name(err->code),
           dl_log_q(q, sizeof(q), err->message));
}

/* ---- pool jobs (jobs.h): each one's file_hub is the owner's ------------------------------------ */

static file_hub *job_hub(const pool_job *j)
{
    return container_of(j->owner, file_hub, jobs);
}

static void maybe_free(file_hub *fh);

static void jobs_drained(job_owner *o)
{
    maybe_free(container_of(o, file_hub, jobs));
}

/* ---- the seen map: each version of each file is handled once ------------------------------------ */

static uint64_t text_hash(const char *s)
{
    uint64_t h = 1469598103934665603ULL;        /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ULL;
    return h;
}

/* Junk a writer planted in the tree is logged once per version of the entry and reason. */
static void report_refused(file_hub *fh, const char *path, const char *reason, uint64_t size, int64_t mtime_ns,
                           uint64_t ino)
{
    int created;
    seen_entry *e = seen_get(&fh->seen, path, &created);
    char q[600];

    if (e == NULL || (!created && e->state == SEEN_PENDING))
        return;                 /* in flight: its intake result comes first, the next scan reports */
    e->listed = fh->scan_gen;
    if (!created && e->state == SEEN_REJECTED && e->size == size && e->mtime_ns == mtime_ns && e->ino == ino)
        return;
    e->size = size;
    e->mtime_ns = mtime_ns;
    e->ino = ino;
    e->state = SEEN_REJECTED;
    e->since = now_s(fh);
    dl_log(DL_LOG_WARN, "hub", "entry refused", "path=%s reason=%s", path, dl_log_q(q, sizeof(q), reason));
}

/* A partial set's seen entry: state SEEN_REJECTED (never handed over, never pruned) with this since,
 * so it is logged once however its shards arrive. */
#define SINCE_PARTIAL (-2.0)

/* Settle time: a file that keeps failing as incomplete without changing for this long is rejected. */
static double settle_seconds(const file_hub *fh)
{
    double s = 2 * fh->poll_interval;
    return s < 2.0 ? 2.0 : s;
}

static void hand_over(file_hub *fh, const hub_candidate *c)
{
    hub_delta d = {.rel = c->rel, .path = c->abs, .root = fh->root, .owned = 0, .index = c->index};
    fh->cb.delta_ready(fh->app, &d);
}

/* A set with a shard missing: remembered (so a later complete version is new), not handed over. */
static void wait_for_shards(seen_entry *e, int created, const hub_candidate *c)
{
    if (!created && e->state == SEEN_PENDING)
        return;                 /* in flight: its result comes first */
    if (created || !(e->state == SEEN_REJECTED && e->since == SINCE_PARTIAL))
        dl_log(DL_LOG_DEBUG, "hub", "sharded delta incomplete, waiting for its shards", "path=%s shards=%" PRIu32,
               c->rel, c->nshards);
    e->size = c->size;
    e->mtime_ns = c->mtime_ns;
    e->ino = c->ino;
    e->state = SEEN_REJECTED;
    e->since = SINCE_PARTIAL;
}

static void consider_candidate(file_hub *fh, const hub_candidate *c)
{
    int created;
    seen_entry *e = seen_get(&fh->seen, c->rel, &created);

    if (e == NULL)
        return;
    e->listed = fh->scan_gen;
    if (c->set && c->partial) {
        wait_for_shards(e, created, c);
        return;
    }
    int same = !created && e->size == c->size && e->mtime_ns == c->mtime_ns && e->ino == c->ino;
    if (same) {
        if (e->state == SEEN_INCOMPLETE && now_s(fh) - e->since >= settle_seconds(fh)) {
            /* stopped changing: one last attempt decides (INCOMPLETE again means truncated for good) */
            e->state = SEEN_PENDING;
            e->since = -1;
            hand_over(fh, c);
        }
        return;
    }
    if (!created && e->state == SEEN_PENDING)
        return;                 /* in flight: its result will be compared with the new version */
    e->size = c->size;
    e->mtime_ns = c->mtime_ns;
    e->ino = c->ino;
    e->since = now_s(fh);
    if (c->set && c->nshards == 0) {
        /* an index that does not parse (yet): handed over once it has settled (above) */
        e->state = SEEN_INCOMPLETE;
        return;
    }
    e->state = SEEN_PENDING;
    dl_log(DL_LOG_DEBUG, "hub", "delta seen", "path=%s bytes=%" PRIu64, c->rel, c->size);
    hand_over(fh, c);
}

/* Kept: what this scan listed, and what is still being taken in. */
static int still_listed(const seen_entry *e, void *arg)
{
    const file_hub *fh = arg;
    return e->listed == fh->scan_gen || e->state == SEEN_PENDING || strcmp(e->key, "global") == 0;
}

static int is_set_rel(const char *rel)
{
    size_t n = strlen(rel), m = strlen(ST_INDEX_SUFFIX);
    return n >= m && memcmp(rel + n - m, ST_INDEX_SUFFIX, m) == 0;
}

static void schedule_scan(file_hub *fh);

static int file_mark_done(hub *h, const char *rel, hub_outcome outcome, const hub_version *v)
{
    file_hub *fh = (file_hub *)h;
    seen_entry *e = seen_find(&fh->seen, rel);
    int changed;

    if (e == NULL)
        return outcome == HUB_INCOMPLETE;
    /* a set's version is ours (the whole set's identity), not the one file intake can describe: a
     * set that changed while it was read is a new identity at the next scan, handed over again */
    if (is_set_rel(rel))
        v = NULL;
    changed = v != NULL && (e->size != v->size || e->mtime_ns != v->mtime_ns || e->ino != v->ino);
    switch (outcome) {
    case HUB_TAKEN:
    case HUB_INVALID:
        e->state = outcome == HUB_TAKEN ? SEEN_DONE : SEEN_REJECTED;
        if (fh->async && fh->st.deltas_waiting > 0)
            schedule_scan(fh);  /* a node's listing may move on to the deltas that wait */
        break;
    case HUB_INCOMPLETE:
        if (e->since < 0) {
            e->state = SEEN_REJECTED;   /* the settled retry: it stopped changing and is still short */
            return 1;
        }
        e->state = SEEN_INCOMPLETE;
        if (v != NULL) {
            e->size = v->size;
            e->mtime_ns = v->mtime_ns;
            e->ino = v->ino;
        }
        if (changed)
            e->since = now_s(fh);
        break;
    case HUB_RETRY:
        e->state = SEEN_INCOMPLETE;     /* our failure: looked at again at the next scan */
        e->size = UINT64_MAX;
        break;
    }
    return 0;
}

/* ---- watching node directories ------------------------------------------------------------------ */

static void watch_event_cb(uv_fs_event_t *h, const char *filename, int events, int status)
{
    (void)filename;
    (void)events;
    (void)status;
    schedule_scan(h->data);
}

static void watch_closed(uv_handle_t *h)
{
    node_watch *w = container_of((uv_fs_event_t *)h, node_watch, h);
    file_hub *fh = w->fh;
    free(w);
    fh->handles--;
    maybe_free(fh);
}

static void unwatch(file_hub *fh, size_t i)
{
    node_watch *w = fh->watches[i];
    fh->watches[i] = fh->watches[--fh->nwatches];
    uv_close((uv_handle_t *)&w->h, watch_closed);
}

static node_watch *find_watch(file_hub *fh, const char *rel)
{
    for (size_t i = 0; i < fh->nwatches; i++)
        if (strcmp(fh->watches[i]->rel, rel) == 0)
            return fh->watches[i];
    return NULL;
}

/* Starts watching a node directory the scan read (best effort: the periodic scan is the backstop). */
static void watch_node_dir(file_hub *fh, const hub_candidate *c)
{
    node_watch *w = find_watch(fh, c->rel);
    size_t rl = strlen(c->rel);

    if (w != NULL) {
        w->listed = fh->scan_gen;
        return;
    }
    if (fh->nwatches == MAX_NODE_WATCHES || (w = calloc(1, sizeof(*w) + rl + 1)) == NULL)
        return;
    if (fh->nwatches % 64 == 0) {
        node_watch **nv = realloc(fh->watches, (fh->nwatches + 64) * sizeof(*nv));
        if (nv == NULL) {
            free(w);
            return;
        }
        fh->watches = nv;
    }
    memcpy(w->rel, c->rel, rl + 1);
    w->fh = fh;
    w->listed = fh->scan_gen;
    if (uv_fs_event_init(fh->loop, &w->h) != 0) {
        free(w);
        return;
    }
    w->h.data = fh;
    fh->handles++;
    fh->watches[fh->nwatches++] = w;
    /* a link swapped in for the directory after the scan would be followed by inotify: harmless, the
     * event only triggers a scan, and the scan never follows links */
    if (uv_fs_event_start(&w->h, watch_event_cb, c->abs, 0) != 0)
        unwatch(fh, fh->nwatches - 1);
}

/* Directories the last complete scan did not read (removed, or replaced by junk) are unwatched. */
static void prune_watches(file_hub *fh)
{
    for (size_t i = fh->nwatches; i-- > 0;)
        if (fh->watches[i]->listed != fh->scan_gen)
            unwatch(fh, i);
}

/* ---- scanning ------------------------------------------------------------------------------------ */

typedef struct scan_result {
    hub_candidate *c;
    size_t n;
    size_t index_parses;
    int published_present, published_sharded;
    uint64_t published_step;
    int published_rc;           /* a junk step file must not stop the intake of deltas */
    dl_error published_err;
} scan_result;

static void scan_work(pool_job *j)
{
    scan_result *r = j->arg;
    /* the memo is only read here: the loop replaces it in scan_done, and one scan runs at a time */
    file_hub *fh = job_hub(j);

    hub_scan_opts opts = {.async = fh->async, .resume = fh->resume, .nresume = fh->nresume};
    j->rc = hubfile_scan(fh->root, fh->memo, fh->nmemo, &opts, &r->c, &r->n, &r->index_parses, &j->err);
    r->published_rc = hubfile_read_published(fh->root, &r->published_present, &r->published_step,
                                             &r->published_sharded, &r->published_err);
}

static void start_adopt(file_hub *fh, uint64_t step, int sharded);

/* Tells the daemon the published step when it is first known or changes.  An unreadable step file
 * counts as none until it is readable (our own publish then replaces it). */
static void report_published(file_hub *fh, const scan_result *r)
{
    int64_t step = r->published_rc == 0 && r->published_present ? (int64_t)r->published_step : -1;

    if (r->published_rc != 0 && fh->reported)
        return;
    if (r->published_rc != 0) {
        char q[600];
        dl_log(DL_LOG_WARN, "hub", "ignoring the published step file", "error=%s",
               dl_log_q(q, sizeof(q), r->published_err.message));
    }
    if (fh->reported && step == fh->reported_step)
        return;
    fh->reported = 1;
    fh->reported_step = step;
    fh->cb.published_seen(fh->app, step);
}

/* ---- async: where each node directory's listing resumes ----------------------------------------- */

static int resume_cmp(const void *a, const void *b)
{
    return strcmp(((const hub_resume *)a)->node, ((const hub_resume *)b)->node);
}

static uint64_t resume_from(const file_hub *fh, const char *node)
{
    hub_resume key;
    const hub_resume *e;

    snprintf(key.node, sizeof(key.node), "%s", node);
    e = fh->nresume ? bsearch(&key, fh->resume, fh->nresume, sizeof(key), resume_cmp) : NULL;
    return e != NULL ? e->from : 0;
}

/* Handed over and answered for good (a junk entry reported, too): no later scan needs to list it. */
static int decided(const file_hub *fh, const hub_candidate *c)
{
    const seen_entry *e;

    if (c->refused != NULL)
        return 1;
    e = seen_find(&fh->seen, c->rel);
    return e != NULL && (e->state == SEEN_DONE || (e->state == SEEN_REJECTED && e->since != SINCE_PARTIAL));
}

/* After a complete async scan: each node directory it read resumes past the decided deltas that begin
 * its listing (in local-step order; the first one still pending, incomplete or retried stops it).  A
 * directory no longer read is forgotten.  1 when a node with deltas waiting moved on (scan again). */
static int update_resume(file_hub *fh, const scan_result *r)
{
    hub_resume *nv = NULL;
    size_t n = 0, cap = 0;
    int blocked = 1, again = 0;
    uint64_t waiting = 0, node_waiting = 0;

    for (size_t i = 0; i < r->n; i++) {
        const hub_candidate *c = &r->c[i];
        delta_path dp;
        if (c->node_dir) {
            if (n == cap) {
                size_t nc = cap ? 2 * cap : 64;
                hub_resume *t = realloc(nv, nc * sizeof(*t));
                if (t == NULL) {
                    free(nv);
                    dl_log(DL_LOG_WARN, "hub", "out of memory remembering where listings resume", "count=%zu", n);
                    return 0;   /* the old points stay: nothing is skipped, only listed again */
                }
                nv = t;
                cap = nc;
            }
            snprintf(nv[n].node, sizeof(nv[n].node), "%s", c->rel + strlen("nodes/"));
            nv[n].from = resume_from(fh, nv[n].node);
            n++;
            blocked = 0;
            node_waiting = c->waiting;
            waiting += c->waiting;
            continue;
        }
        if (blocked || n == 0 || delta_parse_any_path(c->rel, &dp, NULL) != 0 || strcmp(dp.node_id, nv[n - 1].node) != 0)
            continue;
        if (!decided(fh, c) || dp.local_step == UINT64_MAX) {
            blocked = 1;
            continue;
        }
        if (dp.local_step >= nv[n - 1].from) {
            nv[n - 1].from = dp.local_step + 1;
            again |= node_waiting > 0;
        }
    }
    if (n > 1)
        qsort(nv, n, sizeof(*nv), resume_cmp);
    free(fh->resume);
    fh->resume = nv;
    fh->nresume = n;
    if (waiting != fh->st.deltas_waiting && waiting > 0)
        dl_log(DL_LOG_INFO, "hub", "deltas wait for a later scan (each node directory is read in local-step order, "
                                   "a few at a time)",
               "waiting=%" PRIu64 " per_node=%d", waiting, HUBFILE_DELTAS_PER_NODE);
    fh->st.deltas_deferred += waiting;
    fh->st.deltas_waiting = waiting;
    return again;
}

static void scan_done(pool_job *j)
{
    file_hub *fh = job_hub(j);
    scan_result *r = j->arg;

    fh->scan_in_flight = 0;
    fh->scan_gen++;
    fh->st.index_parses += r->index_parses;
    if (j->rc != 0)
        set_error(fh, "scan failed", &j->err);
    else
        fh->st.last_poll = time(NULL);
    if (r->published_rc != 0) {
        report_refused(fh, "global", r->published_err.message, text_hash(r->published_err.message), 0, 0);
    } else {
        seen_entry *g = seen_find(&fh->seen, "global");
        if (g != NULL)
            g->state = SEEN_DONE;       /* readable again: a new problem is reported again */
    }
    for (size_t i = 0; i < r->n; i++)
        if (r->c[i].refused != NULL)
            report_refused(fh, r->c[i].rel, r->c[i].refused, r->c[i].size, r->c[i].mtime_ns, r->c[i].ino);
    if (!fh->closing) {
        report_published(fh, r);
        for (size_t i = 0; i < r->n; i++)
            if (r->c[i].node_dir)
                watch_node_dir(fh, &r->c[i]);
        if (fh->waiting) {
            if (r->published_rc == 0 && r->published_present)
                start_adopt(fh, r->published_step, r->published_sharded);
        } else {
            for (size_t i = 0; i < r->n; i++)
                if (r->c[i].refused == NULL && !r->c[i].node_dir)
                    consider_candidate(fh, &r->c[i]);
        }
        /* a complete listing: files no longer listed (consumed and removed, or older than the
         * newest a node directory is scanned for) are forgotten, and so are their directories */
        if (j->rc == 0) {
            if (hub_index_memo_build(r->c, r->n, &fh->memo, &fh->nmemo) != 0)
                dl_log(DL_LOG_WARN, "hub", "out of memory remembering the indexes", "count=%zu", r->n);
            if (fh->async && !fh->waiting && update_resume(fh, r))
                fh->scan_again = 1;     /* the next deltas of a node that has more */
            if (seen_prune(&fh->seen, still_listed, fh) != 0)
                dl_log(DL_LOG_WARN, "hub", "out of memory pruning the seen files", "count=%zu", fh->seen.count);
            prune_watches(fh);
        }
    }
    hub_candidates_free(r->c, r->n);
    free(r);
    if (fh->scan_again && !fh->closing) {
        fh->scan_again = 0;
        schedule_scan(fh);
    }
}

static void schedule_scan(file_hub *fh)
{
    scan_result *r;

    if (fh->closing)
        return;
    if (fh->scan_in_flight) {
        fh->scan_again = 1;
        return;
    }
    if ((r = calloc(1, sizeof(*r))) == NULL)
        return;
    if (job_queue(&fh->jobs, scan_work, scan_done, r) != 0) {
        free(r);
        return;
    }
    fh->scan_in_flight = 1;
}

static void poll_cb(uv_timer_t *t)
{
    schedule_scan(t->data);
}

/* ---- adopting the tree's global ----------------------------------------------------------------- */

/* The directory of a sharded copy: path minus its file name. */
static void set_dir_of(char *index_path)
{
    char *slash = strrchr(index_path, '/');
    if (slash != NULL)
        *slash = '\0';
}

typedef struct adopt_args {
    uint64_t step;
    int sharded;
    char *path;                 /* the copy: the file, or the index in a directory of its own */
} adopt_args;

static void remove_copy(file_hub *fh, adopt_args *a)
{
    dl_error e;

    if (!a->sharded) {
        unlink(a->path);
        return;
    }
    set_dir_of(a->path);
    if (hubfile_remove_dir(a->path, &e) != 0)
        set_error(fh, "cannot remove a copy of the published global", &e);
}

static void adopt_work(pool_job *j)
{
    file_hub *fh = job_hub(j);
    adopt_args *a = j->arg;
    /* another writer's files: copied through descriptors that never leave the tree, checked to be
     * safetensors files that did not change during the copy (the daemon then validates the copy); a
     * sharded global into a directory of its own */
    if (a->sharded)
        a->path = store_path_incoming_file(fh->state_dir, "file-global-%" PRIu64 "/latest" ST_INDEX_SUFFIX, a->step);
    else
        a->path = store_path_incoming_file(fh->state_dir, "file-global-%" PRIu64 ".safetensors", a->step);
    if (a->path == NULL) {
        j->rc = dl_fail(&j->err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        return;
    }
    if (a->sharded) {
        char *dir = strdup(a->path);
        if (dir == NULL) {
            j->rc = dl_fail(&j->err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
            return;
        }
        set_dir_of(dir);
        j->rc = hubfile_copy_global_set(fh->root, dir, fh->max_header, &j->err);
        free(dir);
        return;
    }
    j->rc = hubfile_copy_global(fh->root, a->path, fh->max_header, &j->err);
}

static void adopt_done(pool_job *j)
{
    file_hub *fh = job_hub(j);
    adopt_args *a = j->arg;

    fh->adopt_in_flight = 0;
    if (j->rc != 0)
        set_error(fh, "cannot adopt the published global, will retry", &j->err);   /* the next scan tries again */
    else if (fh->closing || !fh->waiting)
        remove_copy(fh, a);
    else
        fh->cb.global_ready(fh->app, a->step, a->path);
    free(a->path);
    free(a);
}

static void start_adopt(file_hub *fh, uint64_t step, int sharded)
{
    adopt_args *a;

    if (fh->adopt_in_flight || fh->closing || (a = calloc(1, sizeof(*a))) == NULL)
        return;
    a->step = step;
    a->sharded = sharded;
    if (job_queue(&fh->jobs, adopt_work, adopt_done, a) == 0)
        fh->adopt_in_flight = 1;
    else
        free(a);
}

/* ---- publishing ---------------------------------------------------------------------------------- */

typedef struct publish_args {
    char *src, *optimizer, *record;
    uint64_t step;
    int bootstrap;
    hub_downlink dl;            /* paths owned; dl_on 0: none */
    int dl_on;
} publish_args;

static void downlink_clear(hub_downlink *dl)
{
    free((void *)dl->update_path);
    free((void *)dl->view_path);
    memset(dl, 0, sizeof(*dl));
}

/* *to = a copy of from (paths duplicated).  0, or -1 without memory (*to cleared). */
static int downlink_copy(hub_downlink *to, const hub_downlink *from)
{
    *to = *from;
    to->update_path = from->update_path != NULL ? strdup(from->update_path) : NULL;
    to->view_path = strdup(from->view_path);
    if ((from->update_path != NULL && to->update_path == NULL) || to->view_path == NULL) {
        downlink_clear(to);
        return -1;
    }
    return 0;
}

static int file_set_downlink(hub *h, const hub_downlink *dl)
{
    file_hub *fh = (file_hub *)h;

    downlink_clear(&fh->dl);
    fh->dl_on = 0;
    if (dl == NULL)
        return 0;
    if (downlink_copy(&fh->dl, dl) != 0)
        return -ENOMEM;
    fh->dl_on = 1;
    return 0;
}

static void publish_work(pool_job *j)
{
    publish_args *a = j->arg;
    j->rc = hubfile_publish(job_hub(j)->root, a->src, a->step, a->optimizer, a->bootstrap, a->record,
                            a->dl_on ? &a->dl : NULL, &j->err);
}

static void publish_done(pool_job *j)
{
    file_hub *fh = job_hub(j);
    publish_args *a = j->arg;
    uint64_t step = a->step;

    free(a->src);
    free(a->optimizer);
    free(a->record);
    downlink_clear(&a->dl);
    free(a);
    fh->publishing = 0;
    fh->st.publishing = 0;
    if (j->rc == 0) {
        fh->st.last_publish = time(NULL);
        fh->reported = 1;               /* our own step: not reported back as a change */
        fh->reported_step = (int64_t)step;
    } else {
        fh->st.errors++;
        snprintf(fh->st.last_error, sizeof(fh->st.last_error), "publish: %.240s", j->err.message);
    }
    if (!fh->closing)
        fh->cb.publish_done(fh->app, step, j->rc == 0 ? NULL : j->err.message);
}

static void file_publish(hub *h, const hub_publication *pub)
{
    file_hub *fh = (file_hub *)h;
    uint64_t step = pub->step;
    publish_args *a;
    dl_error e;

    if (fh->publishing || fh->closing)
        return;
    if ((a = calloc(1, sizeof(*a))) != NULL) {
        a->step = step;
        a->bootstrap = pub->bootstrap;
        /* the downlink's files go with the step they were set for */
        a->dl_on = fh->dl_on && fh->dl.step == step;
    }
    if (a == NULL || (a->src = strdup(pub->global_path)) == NULL || (a->optimizer = strdup(pub->optimizer)) == NULL ||
        (pub->record_path != NULL && (a->record = strdup(pub->record_path)) == NULL) ||
        (a->dl_on && downlink_copy(&a->dl, &fh->dl) != 0) ||
        job_queue(&fh->jobs, publish_work, publish_done, a) != 0) {
        if (a != NULL) {
            free(a->src);
            free(a->optimizer);
            free(a->record);
            downlink_clear(&a->dl);
        }
        free(a);
        dl_fail(&e, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        fh->cb.publish_done(fh->app, step, e.message);
        return;
    }
    fh->publishing = 1;
    fh->st.publishing = 1;
}

/* ---- pruning consumed deltas --------------------------------------------------------------------- */

typedef struct prune_args {
    char *rel;
    uint64_t size, ino;
    int64_t mtime_ns;
} prune_args;

static void prune_work(pool_job *j)
{
    prune_args *a = j->arg;
    j->rc = hubfile_remove_delta(job_hub(j)->root, a->rel, a->size, a->mtime_ns, a->ino, &j->err);
}

static void prune_done(pool_job *j)
{
    prune_args *a = j->arg;

    if (j->rc < 0)
        set_error(job_hub(j), "cannot prune a consumed delta", &j->err);
    else if (j->rc == 0)
        dl_log(DL_LOG_DEBUG, "hub", "delta pruned", "path=%s", a->rel);
    else
        dl_log(DL_LOG_INFO, "hub", "delta not pruned: rewritten since it was taken in", "path=%s", a->rel);
    free(a->rel);
    free(a);
}

static void file_prune(hub *h, const char *rel)
{
    file_hub *fh = (file_hub *)h;
    seen_entry *e = seen_find(&fh->seen, rel);
    prune_args *a;

    /* only what was handed over and decided: its version is the one to remove */
    if (fh->closing || e == NULL || e->state != SEEN_DONE || (a = calloc(1, sizeof(*a))) == NULL)
        return;
    if ((a->rel = strdup(rel)) == NULL) {
        free(a);
        return;
    }
    a->size = e->size;
    a->mtime_ns = e->mtime_ns;
    a->ino = e->ino;
    if (job_queue(&fh->jobs, prune_work, prune_done, a) != 0) {
        free(a->rel);
        free(a);
    }
}

/* ---- the interface ------------------------------------------------------------------------------- */

static int file_check_url(const char *url, dl_error *err)
{
    if (strncmp(url, "file:///", 8) != 0 || strcmp(url, "file:///") == 0)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                       "'%.200s' is not file:///abs/dir (an absolute directory other than /)", url);
    return 0;
}

/* ---- options (hub.h's hub_options: config.c reads them through this table) ---- */

typedef struct file_options {
    unsigned create_hub;        /* create_hub: 1 lets the start create a hub directory that does not exist */
} file_options;

static const hub_option file_option_table[] = {
    {"create_hub", HUB_OPT_UINT, offsetof(file_options, create_hub), 0, 1, "0",
     "[0|1]     file:// create the hub directory if it does not exist (else the start refuses it: a typo, or a share "
     "not mounted yet)", NULL},
};

/* At config time the directory's path is checked: every part of it that exists must be a directory.
 * Whether it exists is the start's question (file_open): a share may be mounted in between. */
static int file_load_options(void *opts, const char *url, const char **key, dl_error *err)
{
    (void)opts;
    *key = "hub";
    return fsu_check_dir_path(url + 7, err);
}

/* --check-config: says now what the start would refuse. */
static void file_print_options(const void *opts, const char *url, FILE *out)
{
    const file_options *o = opts;
    struct stat sb;

    if (url != NULL && strncmp(url, "file://", 7) == 0 && stat(url + 7, &sb) != 0 && errno == ENOENT)
        fprintf(out, "# %s does not exist: %s\n", url + 7,
                o->create_hub ? "the start creates it (create_hub = 1)"
                              : "the start refuses it (exit 1) unless create_hub = 1 (--create-hub)");
}

static const hub_options file_options_ops = {
    .opt = file_option_table,
    .n = sizeof(file_option_table) / sizeof(file_option_table[0]),
    .size = sizeof(file_options),
    .load = file_load_options,
    .print = file_print_options,
};

static void free_hub(file_hub *fh)
{
    void (*done)(void *) = fh->close_done;
    void *arg = fh->close_arg;

    seen_free(&fh->seen);
    hub_index_memo_free(fh->memo, fh->nmemo);
    free(fh->resume);
    free(fh->watches);
    downlink_clear(&fh->dl);
    free(fh->root);
    free(fh->state_dir);
    free(fh->incoming);
    free(fh);
    if (done != NULL)
        done(arg);
}

static void maybe_free(file_hub *fh)
{
    if (fh->closing && fh->jobs.in_flight == 0 && fh->handles == 0)
        free_hub(fh);
}

static void handle_closed(uv_handle_t *h)
{
    file_hub *fh = h->data;
    fh->handles--;
    maybe_free(fh);
}

static int file_open(hub **out, uv_loop_t *loop, const hub_config *cfg, const hub_callbacks *cb, void *app,
                     dl_error *err)
{
    extern const hub_ops hub_file_ops;
    const file_options *opts = cfg->options;
    file_hub *fh;
    struct stat sb;
    int rc;

    *out = NULL;
    if ((rc = file_check_url(cfg->url, err)) != 0)
        return rc;
    if ((fh = calloc(1, sizeof(*fh))) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    fh->base.ops = &hub_file_ops;
    fh->loop = loop;
    job_owner_init(&fh->jobs, loop, jobs_drained);
    fh->cb = *cb;
    fh->app = app;
    fh->poll_interval = cfg->poll_interval;
    fh->max_header = cfg->max_header_bytes;
    fh->reported_step = -1;
    if ((fh->root = strdup(cfg->url + 7)) == NULL || (fh->state_dir = strdup(cfg->state_dir)) == NULL ||
        (fh->incoming = store_path_incoming(cfg->state_dir)) == NULL) {
        free_hub(fh);
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    }
    /* open creates nothing in the tree (a start that fails later leaves it as it was): nodes/ is made
     * by start, global/ by the first publish; the root must be a directory, and exist unless
     * --create-hub asks for it (a typo, or a share not mounted yet, would be a hub no worker writes to) */
    if (stat(fh->root, &sb) == 0 ? !S_ISDIR(sb.st_mode) : 0)
        rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "the hub %s is not a directory", fh->root);
    else if (stat(fh->root, &sb) != 0 && !(opts != NULL && opts->create_hub))
        rc = errno == ENOENT ? dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                                       "the hub directory %s does not exist (--hub %s): create it (or mount its "
                                       "share), or give --create-hub to let dilocod create it", fh->root, cfg->url)
                             : dl_fail_errno(err, errno, "cannot stat the hub directory %s (--hub)", fh->root);
    else
        rc = fsu_mkdirs(fh->incoming, err);
    if (rc != 0) {
        free_hub(fh);
        return rc;
    }
    fh->creates_root = stat(fh->root, &sb) != 0;        /* --create-hub: the start says it made it */
    if (stat(fh->root, &sb) == 0 && hubfile_cleanup_temps(fh->root, err) != 0) {
        char q[600];
        dl_log(DL_LOG_WARN, "hub", "cannot remove temporary files of an interrupted publish", "error=%s",
               dl_log_q(q, sizeof(q), err->message));
    }
    uv_timer_init(loop, &fh->poll_timer);
    fh->poll_timer.data = fh;
    fh->handles = 1;
    *out = &fh->base;
    return 0;
}

static void file_start(hub *h)
{
    file_hub *fh = (file_hub *)h;
    char *nodes = NULL;

    dl_error err;

    fh->started = 1;
    uv_timer_start(&fh->poll_timer, poll_cb, 0, (uint64_t)(fh->poll_interval * 1000));
    /* nodes/ itself: a new node directory is seen at once (node directories get their own watch
     * once a scan has read them) */
    if (asprintf(&nodes, "%s/nodes", fh->root) < 0)
        return;
    if (fsu_mkdirs(nodes, &err) != 0)
        set_error(fh, "cannot create the hub's nodes directory", &err);     /* the scans say it again */
    else if (fh->creates_root) {
        char q[600];
        dl_log(DL_LOG_WARN, "hub", "created the hub directory, which did not exist (--create-hub)", "dir=%s",
               dl_log_q(q, sizeof(q), fh->root));
    }
    if (uv_fs_event_init(fh->loop, &fh->nodes_watch) == 0) {
        fh->nodes_watch.data = fh;
        fh->handles++;
        fh->nodes_watch_open = 1;
        if (uv_fs_event_start(&fh->nodes_watch, watch_event_cb, nodes, 0) != 0) {
            fh->nodes_watch_open = 0;
            uv_close((uv_handle_t *)&fh->nodes_watch, handle_closed);
        }
    }
    free(nodes);
}

static void file_set_step(hub *h, uint64_t step, int waiting)
{
    file_hub *fh = (file_hub *)h;

    fh->step = step;
    fh->waiting = waiting;
    /* a new step (or the end of waiting): deltas based on it may already be in the tree */
    if (!fh->closing && fh->started)
        schedule_scan(fh);
}

static void file_set_limits(hub *h, const hub_limits *lim)
{
    ((file_hub *)h)->async = lim->async;
}

static const hub_status *file_status(const hub *h)
{
    return &((const file_hub *)h)->st;
}

static void file_close(hub *h, void (*done)(void *), void *arg)
{
    file_hub *fh = (file_hub *)h;

    fh->closing = 1;
    fh->close_done = done;
    fh->close_arg = arg;
    uv_timer_stop(&fh->poll_timer);
    uv_close((uv_handle_t *)&fh->poll_timer, handle_closed);
    if (fh->nodes_watch_open) {
        fh->nodes_watch_open = 0;
        uv_close((uv_handle_t *)&fh->nodes_watch, handle_closed);
    }
    while (fh->nwatches > 0)
        unwatch(fh, fh->nwatches - 1);
    /* pool jobs (a scan, a copy, a publish) cannot be interrupted: the hub is freed after the last */
}

const hub_ops hub_file_ops = {
    .scheme = "file://",
    .kind = "file",
    .url_form = "file:///abs/dir",
    .publish_writes_locally = 1,
    .options = &file_options_ops,
    .check_url = file_check_url,
    .open = file_open,
    .start = file_start,
    .set_step = file_set_step,
    .publish = file_publish,
    .mark_done = file_mark_done,
    .status = file_status,
    .close = file_close,
    .prune = file_prune,
    .set_limits = file_set_limits,
    .set_downlink = file_set_downlink,
};
