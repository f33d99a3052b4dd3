/* Signed records: Ed25519 keys (common/sign.c) and a step's record (server/core/manifest.c). */
#include "test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "blockhash.h"
#include "manifest.h"
#include "sign.h"
#include "store.h"

static int write_file(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (f == NULL)
        return -1;
    int ok = fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok ? 0 : -1;
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    char *buf = malloc(1 << 20);
    *len = 0;
    if (f != NULL && buf != NULL)
        *len = fread(buf, 1, 1 << 20, f);
    if (f != NULL)
        fclose(f);
    return buf;
}

TEST(sign_keygen_load_sign_verify)
{
    char fp[SIGN_FINGERPRINT_HEX], pubp[512];
    char *path = strdup(test_path("k"));
    sign_key priv, pub;
    unsigned char sig[SIGN_BYTES];
    struct stat sb;
    dl_error err;

    CHECK_EQ(sign_keygen(path, fp, &err), 0);
    CHECK_EQ(stat(path, &sb), 0);
    CHECK_EQ(sb.st_mode & 0777, 0600);
    CHECK(sign_keygen(path, fp, &err) < 0);         /* never overwritten */
    CHECK(strstr(err.message, "not overwritten") != NULL);
    snprintf(pubp, sizeof(pubp), "%s.pub", path);
    CHECK_EQ(sign_key_load(&priv, path, &err), 0);
    CHECK_EQ(sign_pub_load(&pub, pubp, &err), 0);
    CHECK_STR(priv.fingerprint, fp);
    CHECK_STR(pub.fingerprint, fp);
    CHECK_EQ(sign_message(&priv, "abc", 3, sig, &err), 0);
    CHECK_EQ(sign_verify(&pub, "abc", 3, sig), 1);
    CHECK_EQ(sign_verify(&pub, "abd", 3, sig), 0);
    sig[5] ^= 1;
    CHECK_EQ(sign_verify(&pub, "abc", 3, sig), 0);
    CHECK(sign_message(&pub, "abc", 3, sig, &err) < 0);     /* a public key cannot sign */
    sign_key_free(&priv);
    /* a private key others may read is refused, a public key file is not a private key */
    CHECK_EQ(chmod(path, 0640), 0);
    CHECK(sign_key_load(&priv, path, &err) < 0 || (sign_key_free(&priv), 0));
    CHECK(strstr(err.message, "chmod 600") != NULL);
    CHECK_EQ(chmod(pubp, 0600), 0);
    CHECK(sign_key_load(&priv, pubp, &err) < 0);
    sign_key_free(&pub);
    free(path);
}

TEST(manifest_double_is_shortest_exact)
{
    sbuf b = {0};
    manifest_double(&b, 0.7);
    sb_str(&b, " ");
    manifest_double(&b, 0.1 + 0.2);
    sb_str(&b, " ");
    manifest_double(&b, 0.0 / 0.0);
    char *s = sb_take(&b);
    CHECK_STR(s, "0.7 0.30000000000000004 null");
    free(s);
}

TEST(manifest_write_is_deterministic_and_signed)
{
    char fp[SIGN_FINGERPRINT_HEX], hash[MANIFEST_HASH_HEX], again[MANIFEST_HASH_HEX], pubp[512], hex[65];
    char *dir = strdup(test_path("state")), *g = strdup(test_path("g")), *m = strdup(test_path("m"));   /* test_path's buffer is reused */
    sign_key key, pub;
    dl_error err;
    unsigned char digest[BLOCKHASH_SIZE];

    CHECK(dir != NULL && g != NULL && m != NULL);
    CHECK_EQ(mkdir(dir, 0755), 0);
    CHECK_EQ(sign_keygen(test_path("mk"), fp, &err), 0);
    CHECK_EQ(sign_key_load(&key, test_path("mk"), &err), 0);
    snprintf(pubp, sizeof(pubp), "%s.pub", test_path("mk"));
    CHECK_EQ(sign_pub_load(&pub, pubp, &err), 0);
    CHECK_EQ(write_file(g, "global bytes", 12), 0);
    CHECK_EQ(write_file(m, "", 0), 0);      /* an empty file is one empty block */
    manifest_output out[2] = {{"global", "global/latest.safetensors", g}, {"momentum", NULL, m}};
    const char *skeleton = "{\"format\":1,\"outer_step\":7}";

    CHECK_EQ(manifest_write(dir, 7, skeleton, out, 2, &key, hash, &err), 0);
    char *path = store_path_manifest(dir, 7, 0), *sig_path = store_path_manifest(dir, 7, 1);
    size_t len, slen;
    char *text = read_file(path, &len), *sig = read_file(sig_path, &slen);
    CHECK_EQ(slen, SIGN_BYTES);
    CHECK_EQ(sign_verify(&pub, text, len, (const unsigned char *)sig), 1);
    CHECK_EQ(blockhash_bytes("global bytes", 12, digest, &err), 0);
    blockhash_hex(digest, hex);
    char want[1024];
    CHECK_EQ(blockhash_bytes("", 0, digest, &err), 0);
    char empty[65];
    blockhash_hex(digest, empty);
    snprintf(want, sizeof(want), "{\"format\":1,\"outer_step\":7,\"outputs\":{\"global\":{\"path\":\"global/latest."
             "safetensors\",\"block_hash\":\"%s\",\"bytes\":12},\"momentum\":{\"path\":null,\"block_hash\":\"%s\","
             "\"bytes\":0}}}", hex, empty);
    CHECK_EQ(len, strlen(want));
    CHECK(memcmp(text, want, len) == 0);
    /* the record's hash, read back and written again: the same bytes, the same signature */
    CHECK_EQ(manifest_hash_of(dir, 7, again, &err), 0);
    CHECK_STR(again, hash);
    CHECK_EQ(manifest_write(dir, 7, skeleton, out, 2, &key, again, &err), 0);
    CHECK_STR(again, hash);
    size_t len2, slen2;
    char *text2 = read_file(path, &len2), *sig2 = read_file(sig_path, &slen2);
    CHECK(len2 == len && memcmp(text, text2, len) == 0 && slen2 == slen && memcmp(sig, sig2, slen) == 0);
    CHECK_EQ(manifest_sync(dir, 7, &err), 0);
    CHECK_EQ(manifest_hash_of(dir, 8, again, &err), 1);            /* none */
    CHECK(manifest_write(dir, 8, "not json", out, 2, &key, again, &err) < 0);
    /* the newest MANIFEST_KEEP are kept: step 7 goes when step 7 + MANIFEST_KEEP is written */
    CHECK_EQ(manifest_write(dir, 7 + MANIFEST_KEEP, skeleton, out, 1, &key, again, &err), 0);
    CHECK(access(path, F_OK) != 0 && access(sig_path, F_OK) != 0);
    free(text);
    free(sig);
    free(text2);
    free(sig2);
    free(path);
    free(sig_path);
    sign_key_free(&key);
    sign_key_free(&pub);
    free(dir);
    free(g);
    free(m);
}
