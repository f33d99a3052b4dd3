/* curl_uv_aws: what an S3 request needs of a curl_uv transfer beyond curl_uv.h: AWS Signature V4
 * signing by libcurl (CURLOPT_AWS_SIGV4) and methods other than GET/HEAD/POST/PUT. */
#ifndef CURL_UV_AWS_H
#define CURL_UV_AWS_H

#include "curl_uv.h"

/* Signs x for service s3 in region with the key pair.  libcurl computes the signature when it sends
 * the request: the query must already be in SigV4's canonical form (libcurl 7.88 signs it as
 * written) and the payload hash is the request's x-amz-content-sha256 header when it has one. */
void cuv_xfer_aws_sigv4(cuv_xfer *x, const char *region, const char *key_id, const char *secret);
/* The one place an S3 request is signed (the loop's transfers above and the cluster's blocking client,
 * hub/s3_sync.c): libcurl's SigV4 for service s3 in region, with the key pair, on an easy handle. */
void aws_sigv4_setopt(CURL *easy, const char *region, const char *key_id, const char *secret);
/* A method curl_uv has no shape for (DELETE): sent as written, with no body. */
void cuv_xfer_method(cuv_xfer *x, const char *method);

#endif
