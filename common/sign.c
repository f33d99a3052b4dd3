/* sign: Ed25519 keys, signatures and fingerprints on libcrypto (sign.h). */
#include "sign.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/sha.h>

#include "fsutil.h"

int sign_check_private_fd(int fd, const char *what, const char *path, dl_error *err)
{
    struct stat sb;

    if (fstat(fd, &sb) != 0)
        return dl_fail_errno(err, errno, "cannot stat %s %s", what, path);
    if (!S_ISREG(sb.st_mode))
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%s %s is not a regular file", what, path);
    if ((sb.st_mode & 077) != 0)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0,
                       "%s %s is readable or writable by group or others (mode %04o): run chmod 600 %s", what, path,
                       (unsigned)(sb.st_mode & 07777), path);
    return 0;
}

/* Reads a key file (at most SIGN_KEY_FILE_MAX bytes) through one descriptor; check_private: its mode
 * is checked on that descriptor.  *out is malloc'd. */
static int read_key_file(const char *path, int check_private, char **out, size_t *len, dl_error *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK), rc = 0;
    char *buf = NULL;
    size_t n = 0;
    struct stat sb;

    if (fd < 0)
        return dl_fail_errno(err, errno, "cannot open %s", path);
    if (check_private) {
        if ((rc = sign_check_private_fd(fd, "signing key", path, err)) != 0)
            goto out;
    } else if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%s is not a regular file", path);
        goto out;
    }
    if ((buf = malloc(SIGN_KEY_FILE_MAX + 1)) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    if ((rc = fsu_read_fd_capped(fd, buf, SIGN_KEY_FILE_MAX, &n)) != 0) {
        rc = rc == -EFBIG ? dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%s is larger than a PEM key (over %d bytes)",
                                    path, SIGN_KEY_FILE_MAX)
                          : dl_fail_errno(err, -rc, "cannot read %s", path);
        goto out;
    }
    *out = buf;
    *len = n;
    buf = NULL;
out:
    free(buf);
    close(fd);
    return rc;
}

/* A PEM passphrase callback that has none to give: an encrypted key fails to load instead of
 * prompting on a terminal a daemon does not have. */
static int no_passphrase(char *buf, int size, int rwflag, void *u)
{
    (void)buf;
    (void)size;
    (void)rwflag;
    (void)u;
    return 0;
}

/* Fills the public bytes and fingerprint of k->pkey, which must be Ed25519. */
static int key_finish(sign_key *k, const char *path, dl_error *err)
{
    size_t publen = SIGN_PUB_BYTES;
    unsigned char digest[SHA256_DIGEST_LENGTH];

    if (EVP_PKEY_get_base_id((EVP_PKEY *)k->pkey) != EVP_PKEY_ED25519)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%s is not an Ed25519 key", path);
    if (EVP_PKEY_get_raw_public_key((EVP_PKEY *)k->pkey, k->pub, &publen) != 1 || publen != SIGN_PUB_BYTES)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "cannot read the public key of %s", path);
    SHA256(k->pub, SIGN_PUB_BYTES, digest);
    for (size_t i = 0; i < sizeof(digest); i++)
        snprintf(k->fingerprint + 2 * i, 3, "%02x", digest[i]);
    return 0;
}

static int load(sign_key *k, const char *path, int want_private, dl_error *err)
{
    char *text = NULL;
    size_t len = 0;
    BIO *bio = NULL;
    EVP_PKEY *pkey = NULL;
    int rc, is_private = 0;

    memset(k, 0, sizeof(*k));
    if ((rc = read_key_file(path, want_private, &text, &len, err)) != 0)
        return rc;
    if ((bio = BIO_new_mem_buf(text, (int)len)) == NULL) {
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    if (want_private || strstr(text, "PRIVATE KEY-----") != NULL) {
        pkey = PEM_read_bio_PrivateKey(bio, NULL, no_passphrase, NULL);
        is_private = 1;
    } else {
        pkey = PEM_read_bio_PUBKEY(bio, NULL, no_passphrase, NULL);
    }
    if (pkey == NULL) {
        rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%s is not a PEM %s key (or it is encrypted)", path,
                     want_private ? "PKCS#8 private" : "public");
        goto out;
    }
    k->pkey = pkey;
    k->private_key = is_private;
    pkey = NULL;
    if ((rc = key_finish(k, path, err)) != 0)
        sign_key_free(k);
out:
    EVP_PKEY_free(pkey);
    BIO_free(bio);
    if (text != NULL)
        OPENSSL_cleanse(text, len);
    free(text);
    return rc;
}

int sign_key_load(sign_key *k, const char *path, dl_error *err)
{
    return load(k, path, 1, err);
}

int sign_pub_load(sign_key *k, const char *path, dl_error *err)
{
    return load(k, path, 0, err);
}

void sign_key_free(sign_key *k)
{
    EVP_PKEY_free((EVP_PKEY *)k->pkey);
    memset(k, 0, sizeof(*k));
}

/* Writes a memory BIO's bytes into a new file (O_EXCL: never over an existing one), durably. */
static int write_new(const char *path, BIO *bio, mode_t mode, dl_error *err)
{
    char *data;
    long n = BIO_get_mem_data(bio, &data);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);

    if (fd < 0)
        return errno == EEXIST ? dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%s exists: not overwritten", path)
                               : dl_fail_errno(err, errno, "cannot create %s", path);
    /* the umask may narrow the mode, never widen it; fchmod makes it exactly mode */
    if (n < 0 || fchmod(fd, mode) != 0 || write(fd, data, (size_t)n) != (ssize_t)n || fsync(fd) != 0) {
        int e = errno;
        close(fd);
        unlink(path);
        return dl_fail_errno(err, e, "cannot write %s", path);
    }
    if (close(fd) != 0) {
        int e = errno;
        unlink(path);
        return dl_fail_errno(err, e, "cannot write %s", path);
    }
    return 0;
}

int sign_keygen(const char *path, char fingerprint[SIGN_FINGERPRINT_HEX], dl_error *err)
{
    EVP_PKEY_CTX *ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_ED25519, NULL);
    EVP_PKEY *pkey = NULL;
    BIO *priv = BIO_new(BIO_s_mem()), *pub = BIO_new(BIO_s_mem());
    char *pub_path = NULL;
    sign_key k = {0};
    struct stat sb;
    int rc = 0;

    if (ctx == NULL || priv == NULL || pub == NULL || asprintf(&pub_path, "%s.pub", path) < 0) {
        pub_path = NULL;
        rc = dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
        goto out;
    }
    /* both names checked before anything is written: a refusal leaves nothing behind */
    if (lstat(pub_path, &sb) == 0 || lstat(path, &sb) == 0) {
        rc = dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "%s exists: not overwritten",
                     lstat(path, &sb) == 0 ? path : pub_path);
        goto out;
    }
    if (EVP_PKEY_keygen_init(ctx) != 1 || EVP_PKEY_keygen(ctx, &pkey) != 1 ||
        PEM_write_bio_PrivateKey(priv, pkey, NULL, NULL, 0, NULL, NULL) != 1 || PEM_write_bio_PUBKEY(pub, pkey) != 1) {
        rc = dl_fail(err, DL_E_INTERNAL, NULL, 0, "cannot generate an Ed25519 key");
        goto out;
    }
    k.pkey = pkey;
    if ((rc = key_finish(&k, path, err)) != 0)
        goto out;
    if ((rc = write_new(path, priv, 0600, err)) != 0)
        goto out;
    if ((rc = write_new(pub_path, pub, 0644, err)) != 0) {
        unlink(path);
        goto out;
    }
    memcpy(fingerprint, k.fingerprint, SIGN_FINGERPRINT_HEX);
out:
    EVP_PKEY_free(pkey);
    EVP_PKEY_CTX_free(ctx);
    BIO_free(priv);
    BIO_free(pub);
    free(pub_path);
    return rc;
}

int sign_message(const sign_key *k, const void *msg, size_t len, unsigned char sig[SIGN_BYTES], dl_error *err)
{
    EVP_MD_CTX *ctx;
    size_t siglen = SIGN_BYTES;
    int ok;

    if (!k->private_key)
        return dl_fail(err, DL_E_INVALID_ARGUMENT, NULL, 0, "a public key cannot sign");
    if ((ctx = EVP_MD_CTX_new()) == NULL)
        return dl_fail(err, DL_E_NO_MEMORY, NULL, 0, "out of memory");
    /* Ed25519 is one-shot: no digest (NULL), the message itself */
    ok = EVP_DigestSignInit(ctx, NULL, NULL, NULL, (EVP_PKEY *)k->pkey) == 1 &&
         EVP_DigestSign(ctx, sig, &siglen, msg, len) == 1 && siglen == SIGN_BYTES;
    EVP_MD_CTX_free(ctx);
    return ok ? 0 : dl_fail(err, DL_E_INTERNAL, NULL, 0, "Ed25519 signing failed");
}

int sign_verify(const sign_key *k, const void *msg, size_t len, const unsigned char sig[SIGN_BYTES])
{
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    int ok;

    if (ctx == NULL)
        return 0;
    ok = EVP_DigestVerifyInit(ctx, NULL, NULL, NULL, (EVP_PKEY *)k->pkey) == 1 &&
         EVP_DigestVerify(ctx, sig, SIGN_BYTES, msg, len) == 1;
    EVP_MD_CTX_free(ctx);
    return ok;
}
