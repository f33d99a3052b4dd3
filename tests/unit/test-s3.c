/* s3_api.c: URLs, SigV4-canonical queries and the XML answers of real servers (AWS's documented
 * examples, SeaweedFS's own answers) and of hostile ones. */
#include "test.h"

#include <stdlib.h>
#include <string.h>

#include "hub_s3.h"
#include "s3_lease.h"

static char *encode(const char *s, int keep_slash)
{
    sbuf b = {0};
    s3_uri_encode(&b, s, keep_slash);
    return sb_take(&b);
}

TEST(s3_uri_encode_is_sigv4_canonical)
{
    char *a = encode("nodes/", 0), *b = encode("p/nodes/w1/delta_5.safetensors", 1);
    char *c = encode("a b+c=d&e~f-g.h_i", 0), *d = encode("\xc3\xa9\x7f", 0);
    CHECK_STR(a, "nodes%2F");   /* libcurl 7.88 signs the query as written: the slash must be %2F */
    CHECK_STR(b, "p/nodes/w1/delta_5.safetensors");
    CHECK_STR(c, "a%20b%2Bc%3Dd%26e~f-g.h_i");
    CHECK_STR(d, "%C3%A9%7F");  /* upper-case hex, every byte of UTF-8 */
    free(a), free(b), free(c), free(d);
}

TEST(s3_list_query_is_sorted_and_encoded)
{
    char *q1 = s3_list_query("run/nodes/", NULL, NULL, 1000);
    char *q2 = s3_list_query("run/nodes/", "1/abc+=", NULL, 1000);
    CHECK_STR(q1, "list-type=2&max-keys=1000&prefix=run%2Fnodes%2F");
    CHECK_STR(q2, "continuation-token=1%2Fabc%2B%3D&list-type=2&max-keys=1000&prefix=run%2Fnodes%2F");
    free(q1), free(q2);
}

TEST(s3_url_path_style_and_virtual_host)
{
    char *p = s3_url("http://127.0.0.1:8333/", "bkt", 0, "run/global/step_count.json", NULL);
    char *v = s3_url("https://s3.eu-west-1.amazonaws.com", "bkt", 1, "run/a b", "uploads=");
    char *l = s3_url("http://127.0.0.1:8333", "bkt", 0, NULL, "list-type=2&max-keys=1&prefix=x");
    CHECK_STR(p, "http://127.0.0.1:8333/bkt/run/global/step_count.json");
    CHECK_STR(v, "https://bkt.s3.eu-west-1.amazonaws.com/run/a%20b?uploads=");
    CHECK_STR(l, "http://127.0.0.1:8333/bkt/?list-type=2&max-keys=1&prefix=x");
    free(p), free(v), free(l);
}

TEST(s3_parse_url_accepts_buckets_and_prefixes)
{
    char *b, *p;
    dl_error err = {0};
    CHECK_EQ(s3_parse_url("s3://my-bucket.1/run/exp-7", &b, &p, &err), 0);
    CHECK_STR(b, "my-bucket.1");
    CHECK_STR(p, "run/exp-7");
    free(b), free(p);
    CHECK_EQ(s3_parse_url("s3://abc", &b, &p, &err), 0);
    CHECK_STR(p, "");
    free(b), free(p);
    static const char *bad[] = {"s3://", "s3://ab", "s3://Upper", "s3://-abc", "s3://abc-", "s3://a..b",
                                "s3://abc/", "s3://abc//x", "s3://abc/x/", "s3://abc/../x", "s3://abc/./x",
                                "s3://abc/x y", "s3://abc/x%2f", "hf://abc/x", "s3://a_b/x"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        b = p = (char *)"unset";
        if (s3_parse_url(bad[i], &b, &p, &err) != -DL_E_INVALID_ARGUMENT || b != NULL || p != NULL) {
            fprintf(stderr, "  accepted %s\n", bad[i]);
            CHECK(0);
        }
    }
}

/* The ListObjectsV2 example of the AWS S3 API reference (with its namespace). */
static const char aws_listing[] =
    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
    "<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">\n"
    "  <Name>bucket</Name>\n  <Prefix/>\n  <KeyCount>205</KeyCount>\n  <MaxKeys>1000</MaxKeys>\n"
    "  <IsTruncated>false</IsTruncated>\n"
    "  <Contents>\n    <Key>my-image.jpg</Key>\n    <LastModified>2009-10-12T17:50:30.000Z</LastModified>\n"
    "    <ETag>\"fba9dede5f27731c9771645a39863328\"</ETag>\n    <Size>434234</Size>\n"
    "    <StorageClass>STANDARD</StorageClass>\n  </Contents>\n"
    "  <Contents>\n    <Key>run/nodes/w1/delta_500.safetensors</Key>\n"
    "    <LastModified>2009-10-12T17:50:30.000Z</LastModified>\n"
    "    <ETag>&quot;3858f62230ac3c915f300c664312c11f-9&quot;</ETag>\n    <Size>0</Size>\n"
    "    <StorageClass>STANDARD</StorageClass>\n  </Contents>\n"
    "</ListBucketResult>";

/* SeaweedFS (Go's encoding/xml: quotes as &#34;, Owner and a truncated page with a token). */
static const char seaweed_listing[] =
    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
    "<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Name>dl</Name><Prefix>run/nodes/</Prefix>"
    "<MaxKeys>1000</MaxKeys><Delimiter></Delimiter><IsTruncated>true</IsTruncated>"
    "<Contents><Key>run/nodes/a/delta_1.safetensors</Key><ETag>&#34;0cc175b9c0f1b6a831c399e269772661&#34;</ETag>"
    "<Size>1</Size><Owner><ID>0</ID></Owner><StorageClass>STANDARD</StorageClass>"
    "<LastModified>2026-11-30T10:00:00Z</LastModified></Contents>"
    "<ContinuationToken>x</ContinuationToken><NextContinuationToken>run/nodes/a/delta_1.safetensors</NextContinuationToken>"
    "<KeyCount>1</KeyCount><StartAfter></StartAfter></ListBucketResult>";

TEST(s3_parse_listing_aws_example)
{
    s3_listing l;
    dl_error err = {0};
    CHECK_EQ(s3_parse_listing(aws_listing, strlen(aws_listing), &l, &err), 0);
    CHECK_EQ(l.n, 2);
    CHECK_EQ(l.truncated, 0);
    CHECK(l.next_token == NULL);
    CHECK_STR(l.objs[0].key, "my-image.jpg");
    CHECK_EQ(l.objs[0].size, 434234);
    CHECK_STR(l.objs[0].etag, "fba9dede5f27731c9771645a39863328");
    CHECK_STR(l.objs[1].key, "run/nodes/w1/delta_500.safetensors");
    CHECK_STR(l.objs[1].etag, "3858f62230ac3c915f300c664312c11f-9");
    CHECK_EQ(l.objs[1].size, 0);
    s3_listing_free(&l);
}

TEST(s3_parse_listing_seaweedfs_page)
{
    s3_listing l;
    dl_error err = {0};
    CHECK_EQ(s3_parse_listing(seaweed_listing, strlen(seaweed_listing), &l, &err), 0);
    CHECK_EQ(l.n, 1);
    CHECK_EQ(l.truncated, 1);
    CHECK_STR(l.next_token, "run/nodes/a/delta_1.safetensors");
    CHECK_STR(l.objs[0].etag, "0cc175b9c0f1b6a831c399e269772661");
    s3_listing_free(&l);
}

static int listing_refused(const char *xml, const char *why_part)
{
    s3_listing l;
    dl_error err = {0};
    int rc = s3_parse_listing(xml, strlen(xml), &l, &err);
    if (rc == 0) {
        fprintf(stderr, "  accepted: %.120s\n", xml);
        s3_listing_free(&l);
        return 0;
    }
    if (strstr(err.message, why_part) == NULL) {
        fprintf(stderr, "  message \"%s\" lacks \"%s\"\n", err.message, why_part);
        return 0;
    }
    return l.objs == NULL && l.n == 0 && l.next_token == NULL;
}

#define ENTRY(key, size, etag) "<Contents><Key>" key "</Key><Size>" size "</Size><ETag>" etag "</ETag></Contents>"
#define PAGE(body) "<ListBucketResult><IsTruncated>false</IsTruncated>" body "</ListBucketResult>"

TEST(s3_parse_listing_refuses_hostile_answers)
{
    CHECK(listing_refused("<?xml version=\"1.0\"?><!DOCTYPE l [<!ENTITY a \"aaaa\"><!ENTITY b \"&a;&a;&a;&a;\">]>"
                          "<ListBucketResult><Contents><Key>&b;</Key></Contents></ListBucketResult>",
                          "DOCTYPE"));
    CHECK(listing_refused("<?xml version=\"1.0\"?><!DOCTYPE l SYSTEM \"file:///etc/passwd\"><ListBucketResult/>",
                          "DOCTYPE"));
    CHECK(listing_refused(PAGE(ENTRY("k", "-1", "e")), "Size"));
    CHECK(listing_refused(PAGE(ENTRY("k", "+1", "e")), "Size"));
    CHECK(listing_refused(PAGE(ENTRY("k", "1.5", "e")), "Size"));
    CHECK(listing_refused(PAGE(ENTRY("k", "01", "e")), "Size"));
    CHECK(listing_refused(PAGE(ENTRY("k", "18446744073709551616", "e")), "Size"));
    CHECK(listing_refused(PAGE(ENTRY("k", "9007199254740993", "e")), "Size"));
    CHECK(listing_refused(PAGE(ENTRY("k", "1", "\"a b\"")), "ETag"));
    CHECK(listing_refused(PAGE(ENTRY("k", "1", "\"\"")), "ETag"));
    CHECK(listing_refused(PAGE(ENTRY("", "1", "e")), "Key"));
    CHECK(listing_refused(PAGE("<Contents><Key>k</Key><Size>1</Size></Contents>"), "without"));
    CHECK(listing_refused(PAGE("<Contents><Key>k</Key><Key>j</Key><Size>1</Size><ETag>e</ETag></Contents>"),
                          "two Keys"));
    CHECK(listing_refused("<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>", "NextContinuationToken"));
    CHECK(listing_refused("<ListBucketResult><IsTruncated>yes</IsTruncated></ListBucketResult>", "IsTruncated"));
    CHECK(listing_refused("<Error><Code>AccessDenied</Code></Error>", "ListBucketResult"));
    CHECK(listing_refused("<ListBucketResult><Contents>", "well-formed"));
    CHECK(listing_refused("", "well-formed"));
    CHECK(listing_refused("not xml at all", "well-formed"));

    /* a key over S3's 1024-byte limit, an element text over 4096 bytes, nesting past 16 */
    char *big = malloc(20000);
    char key[1100];
    memset(key, 'k', 1025);
    key[1025] = '\0';
    snprintf(big, 20000, PAGE("<Contents><Key>%s</Key><Size>1</Size><ETag>e</ETag></Contents>"), key);
    CHECK(listing_refused(big, "Key"));
    char text[5000];
    memset(text, '1', 4097);
    text[4097] = '\0';
    snprintf(big, 20000, PAGE("<Contents><Key>k</Key><Size>%s</Size><ETag>e</ETag></Contents>"), text);
    CHECK(listing_refused(big, "4096"));
    sbuf deep = {0};
    sb_str(&deep, "<ListBucketResult>");
    for (int i = 0; i < 20; i++)
        sb_str(&deep, "<a>");
    for (int i = 0; i < 20; i++)
        sb_str(&deep, "</a>");
    sb_str(&deep, "</ListBucketResult>");
    char *d = sb_take(&deep);
    CHECK(listing_refused(d, "deeper"));
    free(d);
    free(big);
}

TEST(s3_parse_listing_caps_entries_per_page)
{
    sbuf b = {0};
    s3_listing l;
    dl_error err = {0};
    sb_str(&b, "<ListBucketResult><IsTruncated>false</IsTruncated>");
    for (int i = 0; i < S3_MAX_KEYS_PER_PAGE; i++)
        sb_str(&b, ENTRY("nodes/w/delta_1.safetensors", "7", "\"e\""));
    size_t at = b.len;
    sb_str(&b, "</ListBucketResult>");
    char *ok = sb_take(&b);
    CHECK_EQ(s3_parse_listing(ok, strlen(ok), &l, &err), 0);
    CHECK_EQ(l.n, S3_MAX_KEYS_PER_PAGE);
    s3_listing_free(&l);
    /* one entry more than a page may hold */
    sb_add(&b, ok, at);
    sb_str(&b, ENTRY("x", "1", "e") "</ListBucketResult>");
    char *over = sb_take(&b);
    CHECK(listing_refused(over, "1000 entries"));
    free(ok);
    free(over);
}

TEST(s3_parse_error_documents)
{
    static const char aws[] = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>InvalidAccessKeyId</Code>"
                              "<Message>The AWS Access Key Id you provided does not exist in our records.</Message>"
                              "<AWSAccessKeyId>AKIAWRONG</AWSAccessKeyId><RequestId>4442587FB7D0A2F9</RequestId></Error>";
    char code[64], msg[200];
    CHECK_EQ(s3_parse_error(aws, strlen(aws), code, sizeof(code), msg, sizeof(msg)), 1);
    CHECK_STR(code, "InvalidAccessKeyId");
    CHECK_STR(msg, "The AWS Access Key Id you provided does not exist in our records.");
    /* a long message is cut to the buffer, never overflows it */
    char small[8];
    CHECK_EQ(s3_parse_error(aws, strlen(aws), code, sizeof(code), small, sizeof(small)), 1);
    CHECK_STR(small, "The AWS");
    CHECK_EQ(s3_parse_error("<html>502</html>", 16, code, sizeof(code), msg, sizeof(msg)), 0);
    CHECK_STR(code, "");
    CHECK_EQ(s3_parse_error("", 0, code, sizeof(code), msg, sizeof(msg)), 0);
    CHECK_EQ(s3_parse_error("<Error><Code>", 13, code, sizeof(code), msg, sizeof(msg)), 0);
}

TEST(s3_parse_upload_id_answers)
{
    static const char ok[] = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<InitiateMultipartUploadResult "
                             "xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Bucket>b</Bucket><Key>k</Key>"
                             "<UploadId>VXBsb2FkIElEIGZvciA2aWWpbmcncyBteS1tb3ZpZS5tMnRzIHVwbG9hZA</UploadId>"
                             "</InitiateMultipartUploadResult>";
    char *id;
    dl_error err = {0};
    CHECK_EQ(s3_parse_upload_id(ok, strlen(ok), &id, &err), 0);
    CHECK_STR(id, "VXBsb2FkIElEIGZvciA2aWWpbmcncyBteS1tb3ZpZS5tMnRzIHVwbG9hZA");
    free(id);
    static const char none[] = "<InitiateMultipartUploadResult><Key>k</Key></InitiateMultipartUploadResult>";
    CHECK(s3_parse_upload_id(none, strlen(none), &id, &err) < 0);
    CHECK(id == NULL);
    static const char two[] = "<InitiateMultipartUploadResult><UploadId>a</UploadId><UploadId>b</UploadId>"
                              "</InitiateMultipartUploadResult>";
    CHECK(s3_parse_upload_id(two, strlen(two), &id, &err) < 0);
    CHECK(strstr(err.message, "repeated") != NULL);
}

TEST(s3_clean_etag_forms)
{
    char e[80];
    CHECK_EQ(s3_clean_etag("\"abc-2\"", 7, e, sizeof(e)), 0);
    CHECK_STR(e, "abc-2");
    CHECK_EQ(s3_clean_etag(" abc \r\n", 7, e, sizeof(e)), 0);
    CHECK_STR(e, "abc");
    CHECK(s3_clean_etag("\"a\"b\"", 5, e, sizeof(e)) < 0);
    CHECK(s3_clean_etag("\"\"", 2, e, sizeof(e)) < 0);
    char long_tag[80];
    memset(long_tag, 'a', 65);
    CHECK(s3_clean_etag(long_tag, 65, e, sizeof(e)) < 0);
}

TEST(s3_parse_uploads_of_one_key)
{
    static const char xml[] =
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListMultipartUploadsResult "
        "xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Bucket>b</Bucket><KeyMarker></KeyMarker>"
        "<Upload><Key>run/global/latest.safetensors</Key><UploadId>id-1</UploadId><Initiated>2026-01-01T00:00:00Z"
        "</Initiated></Upload><Upload><Key>run/global/latest.safetensors.other</Key><UploadId>id-2</UploadId></Upload>"
        "<Upload><Key>run/global/latest.safetensors</Key><UploadId>id-3</UploadId></Upload>"
        "<IsTruncated>false</IsTruncated></ListMultipartUploadsResult>";
    char **ids;
    size_t n;
    dl_error err = {0};
    CHECK_EQ(s3_parse_uploads(xml, strlen(xml), "run/global/latest.safetensors", &ids, &n, &err), 0);
    CHECK_EQ(n, 2);
    CHECK_STR(ids[0], "id-1");
    CHECK_STR(ids[1], "id-3");
    s3_uploads_free(ids, n);
    static const char bad[] = "<ListMultipartUploadsResult><Upload><Key>k</Key></Upload></ListMultipartUploadsResult>";
    CHECK(s3_parse_uploads(bad, strlen(bad), "k", &ids, &n, &err) < 0);
    CHECK(ids == NULL && n == 0);
    CHECK(s3_parse_uploads("<ListBucketResult/>", 19, "k", &ids, &n, &err) < 0);
}

TEST(s3_parse_credentials_default_profile)
{
    static const char file[] = "# made by aws configure\n[other]\naws_access_key_id = AKIAOTHER\n"
                               "aws_secret_access_key=other\n\n[default]\r\naws_access_key_id = AKIADEFAULT \r\n"
                               "; comment\naws_secret_access_key =\tsecret/with+chars=\n[third]\naws_access_key_id=x\n";
    char *id, *secret;
    dl_error err = {0};
    CHECK_EQ(s3_parse_credentials(file, strlen(file), &id, &secret, &err), 0);
    CHECK_STR(id, "AKIADEFAULT");
    CHECK_STR(secret, "secret/with+chars=");
    free(id), free(secret);
    /* keys before any section count as the default profile */
    static const char bare[] = "aws_access_key_id=A\naws_secret_access_key=B";
    CHECK_EQ(s3_parse_credentials(bare, strlen(bare), &id, &secret, &err), 0);
    CHECK_STR(id, "A");
    CHECK_STR(secret, "B");
    free(id), free(secret);
    static const char other_only[] = "[other]\naws_access_key_id=A\naws_secret_access_key=B\n";
    CHECK(s3_parse_credentials(other_only, strlen(other_only), &id, &secret, &err) < 0);
    CHECK(id == NULL && secret == NULL);
    CHECK(strstr(err.message, "[default]") != NULL);
    CHECK(s3_parse_credentials("", 0, &id, &secret, &err) < 0);
}

/* The one lease primitive (s3_lease.h): what a claim's answers mean to both S3 clients. */
TEST(s3_lease_answers)
{
    static const char mine[] = "{\"outer_step\": 3, \"instance\": \"a\"}\n";
    static const char theirs[] = "{\"outer_step\": 3, \"instance\": \"b\"}\n";
    CHECK_EQ(s3_lease_after_put(200), S3_LEASE_PUT_WRITTEN);
    CHECK_EQ(s3_lease_after_put(412), S3_LEASE_PUT_READ_BACK);     /* ambiguous: read back */
    CHECK_EQ(s3_lease_after_put(0), S3_LEASE_PUT_FAILED);
    CHECK_EQ(s3_lease_after_put(503), S3_LEASE_PUT_FAILED);
    /* our own bytes read back (an answer we lost) are ours whatever their age */
    CHECK_EQ(s3_lease_judge(mine, strlen(mine), mine, strlen(mine), 0, 1e9, 30, "e1"), S3_LEASE_OURS);
    CHECK_EQ(s3_lease_judge(theirs, strlen(theirs), mine, strlen(mine), 1, 0, 30, "e1"), S3_LEASE_OURS);
    CHECK_EQ(s3_lease_judge(theirs, strlen(theirs), mine, strlen(mine), 0, 29.9, 30, "e1"), S3_LEASE_LIVE);
    CHECK_EQ(s3_lease_judge(theirs, strlen(theirs), mine, strlen(mine), 0, 30, 30, "e1"), S3_LEASE_EXPIRED);
    /* without an ETag to take it over by, an expired claim stays live; nothing written yet is never ours */
    CHECK_EQ(s3_lease_judge(theirs, strlen(theirs), mine, strlen(mine), 0, 99, 30, ""), S3_LEASE_LIVE);
    CHECK_EQ(s3_lease_judge("", 0, "", 0, 0, 0, 30, "e1"), S3_LEASE_LIVE);
    /* a prefix of our bytes is not ours */
    CHECK_EQ(s3_lease_judge(mine, strlen(mine) - 1, mine, strlen(mine), 0, 0, 30, "e1"), S3_LEASE_LIVE);
}

TEST(s3_lease_age_by_the_server_or_by_what_was_seen)
{
    s3_lease_seen seen;
    memset(&seen, 0, sizeof(seen));
    const char *lm = "Sun, 06 Dec 2026 03:00:00 GMT", *date = "Sun, 06 Dec 2026 03:00:45 GMT";
    CHECK(s3_lease_server_age(lm, date) == 45);
    CHECK(s3_lease_server_age(date, lm) == 0);                    /* a Last-Modified after the Date: 0 */
    CHECK(s3_lease_server_age("", date) == -1);
    CHECK(s3_lease_server_age(lm, "not a date") == -1);
    /* the server says 45 s; seen here for 0 s: 45 */
    CHECK(s3_lease_age(&seen, "e1", lm, date, 100) == 45);
    /* a server without dates: the time this very version has been seen unchanged here */
    CHECK(s3_lease_age(&seen, "e2", "", "", 200) == 0);
    CHECK(s3_lease_age(&seen, "e2", "", "", 260) == 60);
    /* a new version (a renewal) starts the count again */
    CHECK(s3_lease_age(&seen, "e3", "", "", 270) == 0);
}
