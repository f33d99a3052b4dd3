/* hub_hf_internal: what hub_hf.c (requests, listing, polling, adoption, lifecycle) and
 * hub_hf_publish.c (the commit API, preupload, LFS batch, multipart) share of the hf:// transport:
 * its handle and the request helpers.  Private to those two files (tests/tools/lint-layers.sh). */
#ifndef HUB_HF_INTERNAL_H
#define HUB_HF_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <cJSON.h>

#include "curl_uv.h"
#include "hub.h"
#include "hub_set.h"
#include "remote.h"
#include "remote_fetch.h"
#include "st_index.h"
#include "strbuf.h"

#define MAX_BACKOFF REMOTE_MAX_BACKOFF
/* step_count.json is about 100 bytes */
#define STEPFILE_BODY_CAP (64u << 10)

typedef struct hf_hub hf_hub;
typedef remote_req hf_req;         /* remote.h: the retrying request */
typedef void (*hf_req_cb)(hf_hub *h, hf_req *r, int ok);

/* What a publish learns of each of its files (pub_state.io[i] is the file itself). */
typedef struct pub_file {
    char sha256[65];
    char sample_b64[700];
    char *content;              /* an index's bytes, for the commit when the Hub wants it inline */
    size_t content_len;
    int lfs;                    /* the Hub's preupload said "lfs" */
} pub_file;

typedef struct pub_state {
    int active;
    uint64_t step;
    int sharded;
    hub_pub_file *io;           /* the shards, then the index (or the one file), open (hub_set_publish_open) */
    pub_file *files;            /* what is learnt of each (io[i]'s) */
    unsigned nfiles, cur;       /* cur: the LFS upload in progress */
    char **deletes;             /* the other layout's files on the Hub, deleted in the commit */
    size_t ndeletes;
    int uploaded;               /* every LFS object is stored: a 412 retry only commits again */
    char *path;
    char optimizer[32];
    int bootstrap;
    int fd;
    uint64_t size;
    char sha256[65];
    char sample_b64[700];
    char *stepfile;
    char parent[48];
    cJSON *batch;               /* the LFS batch answer */
    char **part_etags;
    size_t nparts, part_next;
    uint64_t chunk;
    double backoff;
} pub_state;

struct hf_hub {
    hub base;                   /* first: the transport interface's handle */
    uv_loop_t *loop;
    cuv *curl;
    hub_callbacks cb;
    void *app;
    char *endpoint, *repo, *rev, *token, *state_dir;
    double poll_interval;
    unsigned max_downloads;
    uint64_t max_header;        /* a delta's header cap */
    unsigned list_pages;        /* pages of the current listing */
    unsigned list_new;          /* new candidates taken from the current listing */
    int list_cut;               /* ... and some left for the next listing */
    uv_timer_t poll_timer;
    hub_status st;
    remote_fetch f;             /* the fetch pipeline (remote_fetch.h): requests, seen list, queue, sets, close */
    int polling;                /* a poll cycle is running */
    int64_t published_known;    /* the step last reported (remote_report_step) */
    uint64_t poll_resume_ms;    /* after a 429 or an access problem: no poll before this loop time */
    double access_backoff;      /* seconds between polls while the Hub refuses access (0: it does not) */
    int problem_status;         /* the HTTP status behind st.problem */
    int problem_write;          /* ... refused a write (a commit): reads may still work */
    struct listed_file *lidx, *lshards; /* indexes and shards of the listing in progress (hub_hf.c) */
    size_t nlidx, nlshards;
    int adopt_sharded;          /* the Hub's step_count.json names the index */
    pub_state pub;
    void (*close_done)(void *);
    void *close_arg;
};

/* route: a static name for /metrics (dilocod_hub_requests_total{route,code}); messages name the URL */
hf_req *hf_req_new(hf_hub *h, const char *method, const char *url, const char *route);
/* cb, of this transport's type, runs when r ends (remote_go). */
void hf_req_go(hf_hub *h, hf_req *r, hf_req_cb cb, void *arg);
/* <endpoint>/api/models/<repo>/<what>/<rev>[/<path>][query], malloc'd */
char *hf_api_url(hf_hub *h, const char *what, const char *path, const char *query);
/* <endpoint>/<repo>/resolve/<rev>/<path>, malloc'd */
char *hf_resolve_url(hf_hub *h, const char *path);
/* 1 when url is on the endpoint (the same scheme, host and port, a path under it): only then may
 * it carry the token. */
int hf_url_on_endpoint(const char *endpoint, const char *url);
/* sha256 of the file at path, lower-case hex.  0 or -1. */
int hf_sha256_file(const char *path, char *hex, size_t hex_size);

/* A failure recorded in /status and logged when it changes (remote.h). */
#define set_error(h, ...) remote_error(&(h)->f.rm, __VA_ARGS__)

/* hub_hf_publish.c: hub_ops.publish, and the end of a publish (ok: committed). */
void hf_publish(hub *base, const hub_publication *pub);
void hf_pub_finish(hf_hub *h, int ok);

#endif
