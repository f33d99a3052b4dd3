#include "curl_uv_aws.h"

#include <stdio.h>

void aws_sigv4_setopt(CURL *easy, const char *region, const char *key_id, const char *secret)
{
    char provider[96];

    /* "aws:amz:<region>:s3": the x-amz- header prefix, region and service of the signature (libcurl
     * copies the string) */
    snprintf(provider, sizeof(provider), "aws:amz:%s:s3", region);
    curl_easy_setopt(easy, CURLOPT_AWS_SIGV4, provider);
    curl_easy_setopt(easy, CURLOPT_USERNAME, key_id);
    curl_easy_setopt(easy, CURLOPT_PASSWORD, secret);
}

void cuv_xfer_aws_sigv4(cuv_xfer *x, const char *region, const char *key_id, const char *secret)
{
    aws_sigv4_setopt(x->easy, region, key_id, secret);
}

void cuv_xfer_method(cuv_xfer *x, const char *method)
{
    curl_easy_setopt(x->easy, CURLOPT_CUSTOMREQUEST, method);
}
