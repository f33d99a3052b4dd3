/* api: the HTTP side of dilocod (README.md, HTTP API): the route table and the read-only routes
 * (api.c), uploads (upload.c, upload_set.c) and bearer tokens (auth.c).  It sees the daemon through
 * daemon.h only.  Everything here runs on the loop thread. */
#ifndef API_H
#define API_H

#include <stddef.h>
#include <stdint.h>

#include "daemon.h"
#include "http.h"

/* What api/'s handlers return once they have answered the request themselves (an error response is
 * queued, the failure counted and recorded): the caller only stops, and answers nothing more.  The error
 * convention's named code for "already answered" (server/README.md, "Error convention"); a handler that
 * returns it has called http_respond*, upload_reject or upload_refuse first. */
#define API_ANSWERED (-1)

/* What main wires to the daemon (daemon.h's daemon_front): the routes, their counts, the tokens, the
 * uploads in flight. */
extern const daemon_front api_front;
/* http_server_start's request callback (app is the dilocod). */
void api_on_request(http_conn *c, http_request *req, void *app);
/* http_server_on_response: counts every response by route and status (app is the dilocod). */
void api_count_response(int route, int status, void *app);
/* Range: "bytes=a-b" | "bytes=a-" | "bytes=-n" (one range) of a file of size bytes.  1: *from, *len
 * set; 0: ignore the header (absent, malformed or several ranges: the whole file, as RFC 9110
 * allows); -1: unsatisfiable (416). */
int api_parse_range(const char *h, uint64_t size, uint64_t *from, uint64_t *len);
/* 405 with Allow: allow. */
void api_not_allowed(http_conn *c, const char *allow);

/* upload.c: /nodes/{id}/delta_{n}.safetensors -> id, "n"; /nodes/{id}/deltas -> id, NULL (is_put 0).  0, or
 * -DL_E_INVALID_PATH for a path that is neither. */
int api_parse_node_path(const char *path, char *id, size_t id_size, char *step, size_t step_size, int *is_put);
/* The /nodes/ route (PUT of a delta file, POST of a multipart upload, PUT of a sharded delta's parts). */
void upload_route(dilocod *d, http_conn *c, http_request *req);
/* HTTP uploads being received (each holds two write buffers): the uploads' own count. */
int upload_in_flight(void);
/* The bearer tokens uploads are checked against (--token-file; loaded at startup, reloaded on SIGHUP):
 * the uploads' own, as their count.  Loading replaces them only on success. */
int upload_tokens_load(const char *path, size_t *entries, dl_error *err);
void upload_tokens_free(void);
/* The uploads' part of /status and /metrics (registered last: uploads_in_progress ends /status). */
extern const daemon_provider upload_provider;

#endif
