/* hub_hf: the hf:// transport, a Hugging Face Hub repo spoken to over its HTTP API
 * (its protocol is summarised in README.md, "Through a Hugging Face Hub repo") with libcurl multi
 * inside the libuv loop.
 *
 * Polling: the revision sha every poll interval; the nodes/ tree (all pages, following Link) only
 * when the sha moved.  A new delta path (strict parse_delta_path) is first peeked at with a Range
 * request for its header: deltas based on an older step are never downloaded.  The others are
 * downloaded (bounded parallelism, Range resume after a failure) into cache/incoming, verified
 * against the listing's size and sha256 (LFS) or git blob sha1, and handed to the daemon, which
 * validates them like file:// deltas.  (path, oid) pairs already handled are remembered in
 * <state>/hub_seen.tsv, so nothing is downloaded twice, also across restarts.
 *
 * Sharded deltas (hub.h): indexes and shards are kept aside while the listing's pages arrive; after
 * the last page each index with the shards listed next to it is one candidate, versioned by a hash
 * of every file's path, oid and size.  The index is read whole (at most ST_INDEX_MAX_BYTES, checked
 * against its oid) and parsed; when every shard it lists is listed, the shards are downloaded and
 * verified like single deltas into cache/incoming/hf-set-<version>.set/, and the set is handed over at
 * its index's path.  A partial set waits for a listing with another version.
 *
 * Publishing: ONE commit per outer step with global/latest.safetensors (LFS, basic or multipart as
 * the server says) and global/step_count.json (inline), with parentCommit; a sharded global's commit
 * holds every shard (LFS), the index and step_count.json, and the same commit deletes the files of
 * the other layout that global/ holds at the parent; 412 re-reads the head and
 * retries the commit, 429 waits for Retry-After / RateLimit t, 5xx and network errors retry with
 * exponential backoff and jitter.  A step whose step_count.json is already on the Hub is not
 * committed again (a restart in the middle of a publish).
 *
 * Every answer is treated as hostile: the token goes only to the endpoint's scheme, host and port
 * (Link pages, LFS verify URLs and redirects elsewhere get none), sizes in listings must be exact
 * integers, a download may not grow past its listed size, a delta's header must fit the header cap
 * and describe exactly the listed size before the delta is downloaded, and JSON answers are capped
 * in size. */
#ifndef HUB_HF_H
#define HUB_HF_H

#include "hub.h"

/* The transport (hub.h): hub_hf_ops, row "hf://" of the scheme table. */
extern const hub_ops hub_hf_ops;

/* Parses "hf://ns/repo[@revision]".  repo and rev are malloc'd.  0, or -1 if it is not one. */
int hf_parse_url(const char *url, char **repo, char **rev);

#endif
