/* hub_s3: the s3:// transport, an S3 bucket (AWS S3, R2, MinIO, SeaweedFS) holding the same tree as
 * file:// and hf:// under a prefix: s3://bucket/prefix/nodes/<id>/delta_<n>.safetensors,
 * .../global/latest.safetensors, .../global/step_count.json.  The transport itself is
 * `hub_s3_ops` (hub.h); this header declares the pieces that are tested on their own: the URL, the
 * request URLs and their SigV4-canonical query strings, and the parsers of the server's XML answers.
 *
 * Every XML answer is hostile: parsed with expat (a DOCTYPE is refused outright, so no entity is
 * ever expanded), element nesting, text per element, objects per page and key lengths are capped. */
#ifndef HUB_S3_H
#define HUB_S3_H

#include <stddef.h>
#include <stdint.h>

#include "dl_error.h"
#include "strbuf.h"

/* S3's own key limit; longer keys in a listing are a hostile answer. */
#define S3_MAX_KEY 1024
/* ListObjectsV2 answers at most 1000 keys per page (max-keys); more is a hostile answer. */
#define S3_MAX_KEYS_PER_PAGE 1000
/* The largest page a server may answer for them: 1000 keys of 1024 bytes each escaped as XML (up to 6
 * bytes a byte, "&quot;") with their ETag, size and date; a bigger answer is refused. */
#define S3_LIST_PAGE_CAP (8u << 20)
/* A part of a multipart upload: S3 takes 1..10,000 parts of 5 MiB..5 GiB (the last may be smaller). */
#define S3_MIN_PART_SIZE (5ull << 20)
#define S3_MAX_PART_SIZE (5ull << 30)
#define S3_MAX_PARTS 10000

typedef enum s3_addressing {
    S3_ADDRESSING_AUTO = 0,     /* virtual-host on *.amazonaws.com endpoints, path-style elsewhere */
    S3_ADDRESSING_PATH,         /* http://endpoint/bucket/key */
    S3_ADDRESSING_VIRTUAL,      /* http://bucket.endpoint/key */
} s3_addressing;

/* s3://bucket[/prefix]: bucket by S3's naming rules (3-63 of [a-z0-9.-], starting and ending with a
 * letter or digit), prefix without empty, "." or ".." segments and without a trailing slash.  bucket
 * and prefix are malloc'd (prefix "" when absent).  0 or -DL_E_INVALID_ARGUMENT with why. */
int s3_parse_url(const char *url, char **bucket, char **prefix, dl_error *err);

/* Percent-encodes s as SigV4 canonicalises it (RFC 3986 unreserved characters A-Z a-z 0-9 - . _ ~
 * kept, every other byte %XX in upper case); '/' is kept only when keep_slash (object paths). */
void s3_uri_encode(sbuf *b, const char *s, int keep_slash);

/* What an S3 request's body is, for the payload hash its signature covers. */
typedef enum s3_payload {
    S3_PAYLOAD_NONE,            /* no body: the empty string's sha256 */
    S3_PAYLOAD_MEMORY,          /* a body in memory: its sha256 */
    S3_PAYLOAD_FILE,            /* a body streamed from a file: UNSIGNED-PAYLOAD, as the AWS SDKs send
                                 * over TLS (libcurl could not hash a body it reads through a callback) */
} s3_payload;

/* The x-amz-content-sha256 header line of a request (libcurl's SigV4 signs the payload hash it finds
 * there), for both S3 clients: the loop's (hub_s3.c) and the cluster's (s3_sync.c), which sign with
 * net/curl_uv_aws.h's aws_sigv4_setopt.  0, or -DL_E_INTERNAL when hashing failed. */
int s3_payload_header(s3_payload kind, const void *body, size_t len, char line[128]);

/* The URL of an object (key NULL: the bucket itself) with an optional query that must already be
 * canonical (s3_list_query).  malloc'd, NULL when out of memory. */
char *s3_url(const char *endpoint, const char *bucket, int virtual_host, const char *key, const char *query);

/* The ListObjectsV2 query for keys under prefix, after continuation token (may be NULL), in SigV4's
 * canonical form: parameters sorted by name, names and values encoded by s3_uri_encode (so
 * "nodes/" is sent as "nodes%2F": libcurl signs the query as it is written).  malloc'd. */
char *s3_list_query(const char *prefix, const char *token, const char *start_after, unsigned max_keys);

typedef struct s3_object {
    char *key;
    uint64_t size;
    char etag[80];              /* without the quotes */
} s3_object;

typedef struct s3_listing {
    s3_object *objs;
    size_t n;
    int truncated;              /* IsTruncated: another page follows */
    char *next_token;           /* NextContinuationToken (malloc'd), NULL when absent */
} s3_listing;

/* Parses a ListObjectsV2 answer (ListBucketResult).  An entry with an unusable key, size or ETag is
 * an error for the whole page (the server is not one we can trust then), as is a truncated page
 * without a continuation token.  0 or -DL_E_INVALID_ARGUMENT with why. */
int s3_parse_listing(const char *xml, size_t len, s3_listing *out, dl_error *err);
void s3_listing_free(s3_listing *l);

/* The Code and Message of an <Error> answer (each "" when absent; code and msg are always
 * NUL-terminated).  1 if the body is an S3 error document, else 0. */
int s3_parse_error(const char *xml, size_t len, char *code, size_t code_size, char *msg, size_t msg_size);

/* InitiateMultipartUploadResult's UploadId (malloc'd).  0 or -DL_E_INVALID_ARGUMENT. */
int s3_parse_upload_id(const char *xml, size_t len, char **upload_id, dl_error *err);

/* The UploadIds of ListMultipartUploadsResult entries whose Key is exactly key (at most 1000;
 * *ids malloc'd, each id malloc'd).  0 or -DL_E_INVALID_ARGUMENT. */
int s3_parse_uploads(const char *xml, size_t len, const char *key, char ***ids, size_t *n, dl_error *err);
void s3_uploads_free(char **ids, size_t n);

/* The key pair of an AWS shared credentials file: aws_access_key_id and aws_secret_access_key of
 * the [default] profile (or before any section); '#' and ';' lines are comments.  *key_id and *secret
 * malloc'd.  0 or -DL_E_INVALID_ARGUMENT with why. */
int s3_parse_credentials(const char *text, size_t len, char **key_id, char **secret, dl_error *err);

/* An ETag as S3 sends it: quoted (or not) printable ASCII without spaces or quotes inside, at most
 * 64 characters.  Copies it without the quotes.  0 or -1. */
int s3_clean_etag(const char *in, size_t len, char *out, size_t out_size);

/* What a cluster (s3_cluster.h) needs of an opened s3:// transport to talk to the same bucket: its
 * endpoint, bucket, prefix ("" when none), region, addressing and credentials, as open() resolved them
 * (the environment, a credentials file, the instance's).  Borrowed: valid while the hub is open.
 * 0, or -1 when h is not an s3:// transport. */
struct hub;
typedef struct s3_access {
    const char *endpoint, *bucket, *prefix, *region, *key_id, *secret;
    int virtual_host;
} s3_access;
int hub_s3_access(const struct hub *h, s3_access *out);

#endif
