#!/bin/sh
# Creates the secret files deploy/k8s/secrets/kustomization.yaml turns into Secrets:
#   sh deploy/make-secrets.sh [DIR]     (DIR defaults to deploy/k8s/secrets)
# A file that exists is kept (re-running never rotates a secret by surprise; delete a
# file to rotate it). Values are 32 random bytes from openssl, in hex: safe inside a
# redis:// URL and in gRPC metadata. The files are git-ignored; keep them in your
# secret manager, not in the repository.
set -eu
dir=${1:-$(dirname "$0")/k8s/secrets}
umask 077
mkdir -p "$dir"

hex32() {  # no trailing newline: a Secret's value is the file's bytes, used as they are
    printf %s "$(openssl rand -hex 32)"
}

make() {  # make FILE COMMAND...: write the command's output to FILE unless it exists
    file=$dir/$1
    shift
    if [ -e "$file" ]; then
        echo "kept $file"
        return
    fi
    "$@" > "$file.tmp"
    mv "$file.tmp" "$file"
    echo "wrote $file"
}

api_keys() {
    echo "# KEY TENANT [MAX_INFLIGHT]: one line per API key (router --api-keys-file)"
    echo "$(hex32) default"
}

make ray-token hex32
make redis-password hex32
make api-keys api_keys
