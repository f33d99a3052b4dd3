/* s3_lease: what a claim's answers mean (s3_lease.h), shared by both S3 clients. */
#include "s3_lease.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

#include <curl/curl.h>

s3_lease_put s3_lease_after_put(long status)
{
    if (status == 200)
        return S3_LEASE_PUT_WRITTEN;
    if (status == 412)
        return S3_LEASE_PUT_READ_BACK;
    return S3_LEASE_PUT_FAILED;
}

double s3_lease_server_age(const char *last_modified, const char *date)
{
    time_t lm = last_modified != NULL && last_modified[0] ? curl_getdate(last_modified, NULL) : -1;
    time_t now = date != NULL && date[0] ? curl_getdate(date, NULL) : -1;

    if (lm < 0 || now < 0)
        return -1;
    /* a Last-Modified after the Date of the same answer is a server that lies: age 0, so the time seen
     * here decides */
    return now >= lm ? (double)(now - lm) : 0;
}

double s3_lease_age(s3_lease_seen *seen, const char *etag, const char *last_modified, const char *date, double now)
{
    char version[sizeof(seen->version)];
    double age = s3_lease_server_age(last_modified, date), here;

    snprintf(version, sizeof(version), "%s|%s", etag ? etag : "", last_modified ? last_modified : "");
    if (strcmp(version, seen->version) != 0) {
        memcpy(seen->version, version, sizeof(version));
        seen->since = now;
    }
    here = now - seen->since;
    return here > age ? here : age;
}

s3_lease_verdict s3_lease_judge(const void *read, size_t read_len, const void *mine, size_t mine_len,
                                int ours_by_instance, double age, double lease, const char *etag)
{
    if ((mine_len > 0 && read_len == mine_len && memcmp(read, mine, mine_len) == 0) || ours_by_instance)
        return S3_LEASE_OURS;
    if (age >= lease && etag != NULL && etag[0])
        return S3_LEASE_EXPIRED;
    return S3_LEASE_LIVE;
}
